// Paged prefill attention on AMX tiles (bf16), for CPUs that grant them: q.k and p.v as tdpbf16ps, the
// online softmax between them on AVX-512. A tile multiplies 16 x 32 by 32 x 16 in ~16 cycles where
// vdpbf16ps needs 32 instructions, so here the softmax's exponentials are most of the work.
//
// Everything is transposed (keys or head dims by query rows): the scores come out of the tiles as one
// vector per key holding that key's score for 16 rows, so the online softmax runs on whole vectors with
// no reduction across lanes, and the outputs accumulate as one vector per head dim. Keys are packed as
// [key][D] and values as [key / 32][D][key % 32] (A operands: 16 keys by 32 dims; 16 dims by 32 keys);
// the queries (per tile of 16 rows) and the probabilities are B operands, bf16 pairs along the reduction.
// A tile of rows runs over the key blocks up to its last position, its fp32 outputs in L1 between blocks.
#include "cpu_prefill_attention.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "cpu_vec.h"

namespace pagoda::prefill {

bool amx_granted() {
  static const bool granted = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    if ((edx & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
    // Linux keeps the 8 KB tile state off until the process asks for it (and may refuse: a VM's limits).
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

namespace {

constexpr int kRows = 16;  // query rows a tile: a vector's lanes in the softmax
constexpr int64_t kRowBytes = 64;  // a tile row: 16 fp32, 16 bf16 pairs

// The tile instructions, on tile numbers fixed at compile time (inline assembly: the module is built
// without -mamx flags and runs on CPUs without AMX). Each clobbers memory: a tile load reads what AVX-512
// stores just wrote, and a vector load what a tile store wrote; the compiler must not reorder them.
template <int T> inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T> inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T> inline void tile_zero() { asm volatile("tilezero %%tmm%c0" ::"i"(T) : "memory"); }
// tmm[Acc] += tmm[A] . tmm[B]: A is M x 32 bf16; B is 16 rows of N bf16 pairs, a pair along the reduction.
template <int Acc, int A, int B> inline void tile_dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(Acc), "i"(A), "i"(B) : "memory");
}

template <typename F, int... I> inline void unroll(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
// f(0) .. f(N - 1), each index a compile-time constant (a tile number must be one).
template <int N, typename F> inline void unroll(F&& f) { unroll(f, std::make_integer_sequence<int, N>{}); }

// ldtilecfg's operand (palette 1): all tiles 16 rows of 64 bytes. Tiles 0-3 accumulate fp32, 4-5 hold
// B operands, 6-7 A operands (alternating, so a load need not wait for the previous multiply to read).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// 16 x 16 fp32 in registers transposed: lane j of r[i] becomes lane i of r[j].
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[i + h]), b = _mm512_castps_pd(t[i + h + 2]);
      u[i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(u[i + j], u[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
}

// One thread's state: a tile of 16 query rows and its online softmax, everything transposed (keys or
// head dims by rows), so that a vector holds one key's (or dim's) value for all 16 rows and the softmax
// needs no reduction across lanes. Loads the tile configuration for its thread; releases it at the end.
template <int C>
struct TileRows {
  static constexpr int64_t D = 16 * C, W = D / 2, kSteps = D / 32;  // W: words (bf16 pairs) a key
  const Sequence<bf16>& seq;
  int32_t pos[kRows];
  bf16* out[kRows];
  alignas(64) uint32_t queries[W][kRows];   // B operands of q.k: a word is two head dims of a row
  alignas(64) float scores[kKeys][kRows];   // the block's keys by rows, then masked
  alignas(64) uint32_t probs[kKeys / 2][kRows];  // B operands of p.v: a word is two keys' probabilities
  alignas(64) float acc[D][kRows];          // unnormalised outputs, dims by rows
  __m512 max, sum;                          // the rows' running max (raw scores) and sum

  // Keys as [key][D] (A operands: 16 keys by 32 dims, D apart); values as [key / 32][D][key % 32]
  // (A operands: 16 dims by 32 keys). Keys past len are zero.
  static void pack(const bf16* k_cache, const bf16* v_cache, const int64_t* slots, int64_t len, int64_t padded,
                   int64_t KVH, int64_t kvh, int64_t, uint32_t* key_words, uint32_t* value_words) {
    bf16* keys = reinterpret_cast<bf16*>(key_words);
    bf16* values = reinterpret_cast<bf16*>(value_words);
    for (int64_t key = 0; key < padded; ++key) {
      bf16* values_at = values + (key / 32) * D * 32 + key % 32;
      if (key >= len) {
        std::memset(keys + key * D, 0, D * sizeof(bf16));
        for (int64_t d = 0; d < D; ++d) values_at[d * 32] = bf16(0.0f);
        continue;
      }
      const int64_t offset = (slots[key] * KVH + kvh) * D;
      std::memcpy(keys + key * D, k_cache + offset, D * sizeof(bf16));
      for (int64_t d = 0; d < D; ++d) values_at[d * 32] = v_cache[offset + d];
    }
  }

  TileRows(const Sequence<bf16>& seq, int64_t) : seq(seq) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = kRowBytes, config.rows[t] = kRows;
    asm volatile("ldtilecfg %0" ::"m"(config));
  }
  ~TileRows() { asm volatile("tilerelease" ::: "memory"); }
  TileRows(const TileRows&) = delete;
  TileRows& operator=(const TileRows&) = delete;

  void operator()(const uint32_t* keys, const uint32_t* values, int64_t first_query, int64_t count, int64_t kvh) {
    const int64_t n = seq.G * count;  // rows: the kv head's G query heads by the task's positions
    for (int64_t r0 = 0; r0 < n; r0 += kRows) {
      for (int r = 0; r < kRows; ++r) {  // rows past n repeat the last one
        const int64_t live = std::min<int64_t>(r0 + r, n - 1), g = live / count, i = first_query + live % count;
        const uint32_t* q = reinterpret_cast<const uint32_t*>(seq.q + i * seq.q_stride + (kvh * seq.G + g) * D);
        for (int64_t w = 0; w < W; ++w) queries[w][r] = q[w];
        out[r] = seq.out + i * seq.out_stride + (kvh * seq.G + g) * D;
        pos[r] = static_cast<int32_t>(seq.first_pos + i);
      }
      attend_tile(reinterpret_cast<const bf16*>(keys), reinterpret_cast<const bf16*>(values),
                  std::min<int64_t>(kRows, n - r0));
    }
  }

  void attend_tile(const bf16* keys, const bf16* values, int64_t live) {
    const int64_t low = *std::min_element(pos, pos + kRows), high = *std::max_element(pos, pos + kRows);
    max = _mm512_set1_ps(kNegInf), sum = _mm512_setzero_ps();
    std::fill(&acc[0][0], &acc[0][0] + D * kRows, 0.0f);
    const int64_t first_block = seq.window > 0 ? std::max<int64_t>(0, low - seq.window + 1) / kKeys : 0;
    for (int64_t block = first_block; block * kKeys <= high; ++block) {
      score_block(keys + block * kKeys * D);
      softmax_block(block * kKeys, low, high);
      accumulate_block(values + block * kKeys * D);
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_mul_ps(_mm512_load_ps(acc[d0 + i]), inv);
      transpose16(v);
      for (int64_t r = 0; r < live; ++r) store16(out[r] + d0, v[r], 0xFFFF);
    }
  }

  // scores = the block's 64 keys . the rows: an accumulator per 16 keys, D / 32 steps of 32 dims.
  void score_block(const bf16* block_keys) {
    unroll<4>([&](auto j) { tile_zero<j>(); });
    unroll<kSteps>([&](auto step) {
      tile_load<4 + step % 2>(&queries[step * 16][0], kRowBytes);
      unroll<4>([&](auto j) {
        tile_load<6 + j % 2>(block_keys + j * 16 * D + step * 32, D * sizeof(bf16));
        tile_dot<j, 6 + j % 2, 4 + step % 2>();
      });
    });
    unroll<4>([&](auto j) { tile_store<j>(&scores[j * 16][0], kRowBytes); });
  }

  // The rows' online softmax over the block (keys from `base`), all 16 rows at once: the probabilities
  // exp(scale (s - max)) go to `probs` as bf16 pairs of consecutive keys, their fp32 sum to `sum`, and
  // the outputs so far are scaled down by how much the max rose.
  void softmax_block(int64_t base, int64_t low, int64_t high) {
    const bool inside = base + kKeys - 1 <= low && (seq.window == 0 || base > high - seq.window);
    __m512 block_max[4];
    for (int v = 0; v < 4; ++v) block_max[v] = _mm512_set1_ps(kNegInf);
    const __m512i positions = _mm512_loadu_si512(pos);
    for (int64_t k = 0; k < kKeys; ++k) {
      __m512 s = _mm512_load_ps(scores[k]);
      if (!inside) {  // on the diagonal or the window's edge: keys a row must not see are -inf
        const __m512i key = _mm512_set1_epi32(static_cast<int>(base + k));
        __mmask16 visible = _mm512_cmple_epi32_mask(key, positions);
        if (seq.window > 0)
          visible &= _mm512_cmpgt_epi32_mask(key, _mm512_sub_epi32(positions, _mm512_set1_epi32(seq.window)));
        s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), visible, s);
        _mm512_store_ps(scores[k], s);
      }
      block_max[k % 4] = _mm512_max_ps(block_max[k % 4], s);
    }
    const __m512 new_max = _mm512_max_ps(_mm512_max_ps(max, _mm512_max_ps(block_max[0], block_max[1])),
                                         _mm512_max_ps(block_max[2], block_max[3]));
    // exp(scale (s - max)) as 2^(s c - max c); a row that has seen no key yet (max -inf) shifts by 0.
    const __m512 c = _mm512_set1_ps(seq.scale * 1.44269504088896341f);
    const __mmask16 seen = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    const __m512 shift = _mm512_maskz_mul_ps(seen, new_max, c);
    const __m512 alpha = exp2_16(_mm512_fmsub_ps(max, c, shift));  // 0 where max was -inf
    max = new_max;
    if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0)
      for (int64_t d = 0; d < D; ++d) _mm512_store_ps(acc[d], _mm512_mul_ps(_mm512_load_ps(acc[d]), alpha));
    // Pairs of keys interleaved per row: lane 2r holds key 2k's probability for row r, 2r + 1 key 2k + 1's.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < kKeys; k += 2) {
      const __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores[k]), c, shift));
      const __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_load_ps(scores[k + 1]), c, shift));
      total[0] = _mm512_add_ps(total[0], p0), total[1] = _mm512_add_ps(total[1], p1);
      const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));
      _mm512_store_si512(probs[k / 2], _mm512_permutexvar_epi16(interleave, pair));
    }
    sum = _mm512_fmadd_ps(sum, alpha, _mm512_add_ps(total[0], total[1]));
  }

  // acc += the block's values . probs: dims in groups of up to 4 accumulators of 16, 2 steps of 32 keys.
  void accumulate_block(const bf16* block_values) {
    unroll<(C + 3) / 4>([&](auto group) {
      constexpr int first = group * 4, dims = std::min(4, C - first);  // dims: accumulators, 16 dims each
      unroll<dims>([&](auto c) { tile_load<c>(&acc[(first + c) * 16][0], kRowBytes); });
      unroll<2>([&](auto step) {
        tile_load<4 + step>(&probs[step * 16][0], kRowBytes);
        unroll<dims>([&](auto c) {
          tile_load<6 + c % 2>(block_values + (step * D + (first + c) * 16) * 32, kRowBytes);
          tile_dot<c, 6 + c % 2, 4 + step>();
        });
      });
      unroll<dims>([&](auto c) { tile_store<c>(&acc[(first + c) * 16][0], kRowBytes); });
    });
  }
};

}  // namespace

void attend_amx(const Sequence<bf16>& seq, const bf16* k_cache, const bf16* v_cache, const int64_t* slots,
                int64_t KVH, int64_t D) {
  // ~256 rows a task, whole tiles of one query head's consecutive positions where the block allows.
  const int64_t block = std::max<int64_t>(kRows, 256 / seq.G / kRows * kRows);
  switch (D / 16) {
    case 2: return run_tasks<bf16, TileRows<2>>(seq, k_cache, v_cache, slots, KVH, D, block);
    case 4: return run_tasks<bf16, TileRows<4>>(seq, k_cache, v_cache, slots, KVH, D, block);
    case 6: return run_tasks<bf16, TileRows<6>>(seq, k_cache, v_cache, slots, KVH, D, block);
    case 8: return run_tasks<bf16, TileRows<8>>(seq, k_cache, v_cache, slots, KVH, D, block);
  }
}

}  // namespace pagoda::prefill
