// Paged prefill attention on the CPU: one sequence's queries (a prompt or a chunk of one) attending
// causally to its keys in the paged cache, flash-attention style; bf16 on AMX tiles where the CPU grants
// them (cpu_prefill_attention_amx.cpp), else on vdpbf16ps; fp32 on FMAs.
//
// Torch's SDPA needs the keys gathered out of the cache and repeated to the query heads, and runs at
// about 100 GFLOP/s here in either dtype (a quarter of the bf16 GEMMs' rate without AMX). Here:
//  - each kv head's keys and values are packed once from their slots into the layouts the dot
//    products read (32-bit words along the reduction: head dims for q.k, keys for p.v; a bf16 word is
//    a pair, for vdpbf16ps), zero past the sequence;
//  - a task is one kv head and a block of query positions, its rows the G query heads sharing that kv
//    head times the block's positions, so every packed key block serves G heads from L1;
//  - per key block of 64 and tile of R rows: scores in registers, an online softmax in fp32, the
//    probabilities in the model dtype (bf16 rounds them, as torch's flash kernel does) accumulated into
//    fp32 outputs; key blocks wholly outside a block's causal window are skipped.
#include "cpu_prefill_attention.h"

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace pagoda::prefill {
namespace {

// An element type's 32-bit words: bf16 packs two elements a word, and `dot` adds both products of a
// word pair to each fp32 lane (vdpbf16ps); fp32 is one element a word and an FMA.
template <typename T> struct Words;
template <> struct Words<bf16> {
  using Bits = uint16_t;
  static constexpr int64_t kPer = 2;
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
  static void store(uint32_t* words, const __m512 p[4]) {  // 64 probabilities, rounded to bf16
    for (int v = 0; v < 4; v += 2)
      _mm512_storeu_si512(words + v * 8, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p[v + 1], p[v])));
  }
};
template <> struct Words<float> {
  using Bits = uint32_t;
  static constexpr int64_t kPer = 1;
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
  static void store(uint32_t* words, const __m512 p[4]) {
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(reinterpret_cast<float*>(words) + v * 16, p[v]);
  }
};

inline __m512i broadcast(const uint32_t* words, int64_t w) { return _mm512_set1_epi32(static_cast<int>(words[w])); }
inline __m512i load(const uint32_t* words) { return _mm512_loadu_si512(words); }


// One kv head's keys as [key / 16][word][key % 16] (W = D / kPer words a key), and its values as
// [key / kPer][D][key % kPer] elements (a word: dim d of kPer consecutive keys). Keys past len are zero.
template <typename T>
void pack_kv(const T* k_cache, const T* v_cache, const int64_t* slots, int64_t len, int64_t padded, int64_t KVH,
             int64_t kvh, int64_t D, uint32_t* keys, uint32_t* values) {
  using Bits = typename Words<T>::Bits;
  constexpr int64_t per = Words<T>::kPer;
  const int64_t W = D / per;
  for (int64_t key = 0; key < padded; ++key) {
    const int64_t offset = (slots[std::min(key, len - 1)] * KVH + kvh) * D;
    const uint32_t* k = reinterpret_cast<const uint32_t*>(k_cache + offset);
    const Bits* v = reinterpret_cast<const Bits*>(v_cache + offset);
    const bool live = key < len;
    uint32_t* kdst = keys + (key / 16) * W * 16 + key % 16;
    for (int64_t w = 0; w < W; ++w) kdst[w * 16] = live ? k[w] : 0;
    Bits* vdst = reinterpret_cast<Bits*>(values) + (key / per) * D * per + key % per;
    for (int64_t d = 0; d < D; ++d) vdst[d * per] = live ? v[d] : 0;
  }
}

// One row's raw scores (4 vectors) against a block, masked to the keys [lo, hi): the online softmax
// state (max of the raw scores, per-lane sums) updated and the probabilities exp(scale (s - max))
// stored as T into `probs`. Returns the factor for the row's earlier output.
template <typename T>
inline float softmax_row(__m512 s[4], int64_t lo, int64_t hi, float scale, float& max, __m512& sum,
                         uint32_t* probs) {
  __mmask16 live[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  if (lo > 0 || hi < kKeys) {  // a block on the diagonal or the window's edge
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int v = 0; v < 4; ++v) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v));
      live[v] = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo))) &
                _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(hi)));
      s[v] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live[v], s[v]);
    }
  }
  const __m512 block_max = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
  const float new_max = std::max(max, _mm512_reduce_max_ps(block_max));
  if (new_max == kNegInf) {  // no key of this block, nor before it, is visible to the row
    std::fill(probs, probs + kKeys, 0u);
    return 1.0f;
  }
  // exp(scale (s - max)) as 2^(s c - max c): one fused multiply-subtract before exp2.
  const float c = scale * 1.44269504088896341f;
  const float alpha = _mm512_cvtss_f32(exp2_16(_mm512_set1_ps((max - new_max) * c)));  // 0 for max = -inf
  const __m512 vc = _mm512_set1_ps(c), shift = _mm512_set1_ps(new_max * c);
  __m512 total = _mm512_setzero_ps();
  for (int v = 0; v < 4; ++v) {
    s[v] = exp2_16(_mm512_fmsub_ps(s[v], vc, shift));  // masked keys: exp2(-inf) = 0
    total = _mm512_add_ps(total, s[v]);
  }
  Words<T>::store(probs, s);
  sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha), total);
  max = new_max;
  return alpha;
}

// Raw scores of R query rows against one block of 64 packed keys (W words a key).
template <typename T, int R>
inline void score_tile(const uint32_t* const* q, const uint32_t* keys, int64_t W, __m512 s[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) s[r][v] = _mm512_setzero_ps();
  for (int64_t w = 0; w < W; ++w) {
    __m512i k[4];
    for (int v = 0; v < 4; ++v) k[v] = load(keys + (v * W + w) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i qr = broadcast(q[r], w);
      for (int v = 0; v < 4; ++v) s[r][v] = Words<T>::dot(s[r][v], qr, k[v]);
    }
  }
}

// out[r] = out[r] * alpha[r] + P[r] @ V for one key block; a row of P is 64 / kPer words.
template <typename T, int R, int C>
inline void accumulate_tile(const uint32_t* probs, const uint32_t* values, float* const* out, const float* alpha) {
  constexpr int64_t D = 16 * C, words = kKeys / Words<T>::kPer;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out[r] + c * 16), _mm512_set1_ps(alpha[r]));
  for (int64_t j = 0; j < words; ++j) {
    __m512i v[C];
    for (int c = 0; c < C; ++c) v[c] = load(values + j * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i p = broadcast(probs + r * kKeys, j);
      for (int c = 0; c < C; ++c) acc[r][c] = Words<T>::dot(acc[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[r] + c * 16, acc[r][c]);
}

// The vdpbf16ps / FMA form's per-thread state: the online softmax of a task's rows (rows past the
// task's count are scratch for the last tile).
template <typename T, int C>
struct Rows {
  static constexpr int64_t D = 16 * C, per = Words<T>::kPer, W = D / per;  // W: words a key
  static constexpr int R = C <= 4 ? 6 : 24 / C;  // rows per tile: R x C output accumulators in registers
  const Sequence<T>& seq;
  std::vector<const uint32_t*> q;
  std::vector<T*> out;
  std::vector<int64_t> pos;
  std::vector<float> max, acc;  // acc: [rows][D] fp32
  std::vector<__m512> sum;      // per lane, reduced at the end

  static constexpr auto pack = pack_kv<T>;

  Rows(const Sequence<T>& seq, int64_t block)
      : seq(seq), q(seq.G * block + R), out(q.size()), pos(q.size()), max(q.size()), acc(q.size() * D),
        sum(q.size()) {}

  void operator()(const uint32_t* keys, const uint32_t* values, int64_t first_query, int64_t count, int64_t kvh) {
    const int64_t n = seq.G * count, padded = (n + R - 1) / R * R;
    for (int64_t r = 0; r < padded; ++r) {
      const int64_t live = std::min(r, n - 1), g = live / count, i = first_query + live % count;
      q[r] = reinterpret_cast<const uint32_t*>(seq.q + i * seq.q_stride + (kvh * seq.G + g) * D);
      out[r] = seq.out + i * seq.out_stride + (kvh * seq.G + g) * D;
      pos[r] = seq.first_pos + i;
      max[r] = kNegInf;
      sum[r] = _mm512_setzero_ps();
    }
    std::fill(acc.begin(), acc.begin() + padded * D, 0.0f);
    const int64_t low = seq.first_pos + first_query, high = low + count - 1;  // the block's positions
    const int64_t first_block = seq.window > 0 ? std::max<int64_t>(0, low - seq.window + 1) / kKeys : 0;
    for (int64_t block = first_block; block * kKeys <= high; ++block)
      for (int64_t r0 = 0; r0 < padded; r0 += R) attend_tile(keys, values, block, r0);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum[r]));
      for (int c = 0; c < C; ++c)
        store16(out[r] + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + c * 16), inv), 0xFFFF);
    }
  }

  // Rows r0 .. r0 + R against key block `block`.
  void attend_tile(const uint32_t* keys, const uint32_t* values, int64_t block, int64_t r0) {
    const int64_t base = block * kKeys;
    __m512 s[R][4];
    score_tile<T, R>(q.data() + r0, keys + block * kKeys * W, W, s);
    alignas(64) uint32_t probs[R][kKeys];
    float alpha[R];
    float* rows[R];
    for (int r = 0; r < R; ++r) {
      const int64_t p = pos[r0 + r];
      const int64_t lo = seq.window > 0 ? p - seq.window + 1 - base : 0, hi = p + 1 - base;
      alpha[r] = softmax_row<T>(s[r], lo, hi, seq.scale, max[r0 + r], sum[r0 + r], probs[r]);
      rows[r] = acc.data() + (r0 + r) * D;
    }
    accumulate_tile<T, R, C>(&probs[0][0], values + block * (kKeys / per) * D, rows, alpha);
  }
};

template <typename T>
void dispatch_head_dim(const Sequence<T>& seq, const T* k, const T* v, const int64_t* s, int64_t KVH, int64_t D) {
  // ~256 rows a task: a block's scores and outputs stay in L2 beside the packed keys and values.
  const int64_t block = std::max<int64_t>(16, 256 / seq.G);
  switch (D / 16) {
    case 2: return run_tasks<T, Rows<T, 2>>(seq, k, v, s, KVH, D, block);
    case 4: return run_tasks<T, Rows<T, 4>>(seq, k, v, s, KVH, D, block);
    case 6: return run_tasks<T, Rows<T, 6>>(seq, k, v, s, KVH, D, block);
    case 8: return run_tasks<T, Rows<T, 8>>(seq, k, v, s, KVH, D, block);
  }
}

template <typename T>
Sequence<T> sequence(const torch::Tensor& q, const torch::Tensor& out, const torch::Tensor& slots, int64_t KVH,
                     int64_t window, double scale) {
  const int64_t T_ = q.size(0), H = q.size(1);
  return {q.data_ptr<T>(), out.data_ptr<T>(), q.stride(0), out.stride(0), T_, slots.size(0) - T_,
          H, H / KVH, window, static_cast<float>(scale)};
}

}  // namespace
}  // namespace pagoda::prefill

bool prefill_attention_amx_available() { return pagoda::prefill::amx_granted(); }

// q: [T, H, D] fp32 or bf16 (rows may be strided: a view into the fused qkv); out: [T, H, D], written
// in place; caches [S, KVH, D], all of one dtype; key_slots: [L] int64, the slots of positions
// 0..L-1, the last T of which are the queries' own. window: 0 for none. use_amx: bf16 on AMX tiles
// where the CPU grants them (false: vdpbf16ps, to compare the two forms).
void paged_prefill_attention_(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& key_slots, int64_t window, double scale, torch::Tensor& out,
                              bool use_amx) {
  using namespace pagoda::prefill;
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 3, "q, out [T,H,D]; caches [S,KVH,D]");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fp32 or bf16 only");
  TORCH_CHECK(out.scalar_type() == dtype && k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "q, out and the caches must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "heads of a query row must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  auto slots = key_slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) >= T, "int64 slots, one a key");
  TORCH_CHECK(H % KVH == 0 && D % 32 == 0 && D <= 128 && k_cache.size(2) == D,
              "head_dim 32..128 in steps of 32, query heads a multiple of kv heads");
  if (T == 0) return;
  const int64_t* s = slots.data_ptr<int64_t>();
  if (dtype == at::kFloat)
    return dispatch_head_dim(sequence<float>(q, out, slots, KVH, window, scale), k_cache.data_ptr<float>(),
                             v_cache.data_ptr<float>(), s, KVH, D);
  const auto seq = sequence<bf16>(q, out, slots, KVH, window, scale);
  const bf16 *k = k_cache.data_ptr<bf16>(), *v = v_cache.data_ptr<bf16>();
  if (use_amx && amx_granted()) return attend_amx(seq, k, v, s, KVH, D);
  dispatch_head_dim(seq, k, v, s, KVH, D);
}
