// Paged decode attention on the CPU: one query token per sequence, keys and values read in place
// from the paged cache through each sequence's slot list, without gathering them into a batch.
//
// q: [B, H, D]; the cache (kv_quant.h's view): K, V [num_slots, KVH, D] in q's dtype, int8 codes with their
// scales [num_slots, KVH], or e4m3 codes with the layer's scales; slots: [B, L] int64 (padded); seq_lens: [B]
// int64; window: 0 for none, else keys at positions >= seq_len - window; softcap: 0 for none, else each score s
// becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). Codes are widened in registers: a key's score
// is its codes' dot product times its scale, a value's weight its probability times its scale (fp8's layer scales
// fold into the query's scale and the normalisation); nothing is dequantized to memory.
// Work is split over (sequence, kv head); each task handles the G = H / KVH query heads sharing that
// kv head, so every key and value row is read from memory once and used G times: keys widened to fp32 once
// per block of 16 into an L1 tile that every head scores from (widening int8 or e4m3 codes costs more than
// the dot product), values from registers.
// Three passes per task, each vectorised: scores (q.k, 16 keys at a time, one horizontal sum per 16
// keys), exp (a polynomial over 16 scores at a time), then the weighted sum of values. Scores, the
// softmax and the accumulation are in fp32.
// A task's rows are scattered (one kv head's 64-256 bytes in every slot row, blocks anywhere), too short
// for the hardware prefetcher to run ahead, so the kernel asks for them itself: while it scores a block
// of 16 keys it prefetches those keys' value rows and the next task's key and value rows at the same
// positions into L2. At bench-125m's batch 32 this read the KV cache 1.55x (fp32) and 1.6x (bf16) faster
// (14 -> 22 GB/s of KV; prefetching only this task's values: 1.05x and 1.3x).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_attention_int8.h"
#include "cpu_kv_cache.h"
#include "cpu_ops.h"
#include "cpu_simd.h"
#include "cpu_vec.h"

namespace {

using pagoda::exp16;
using pagoda::load16;
using pagoda::score_int8_keys;
using pagoda::transpose_sum16;
using pagoda::kv_quant::fp8_e4m3;
using pagoda::kv_quant::KVCacheView;
using pagoda::kv_quant::KVFormat;

constexpr int kMaxGroup = pagoda::kMaxGroup;

// Where a task's key and value rows are: row i at slots[i] * stride + offset of either cache.
struct TaskRows {
  const int64_t* slots = nullptr;  // nullptr: no task
  int64_t count = 0;
  int64_t offset = 0;
};

// Rows [from, to) of a task, keys and/or values, into L2.
template <typename T>
inline void prefetch_rows(const T* cache, const TaskRows& rows, int64_t from, int64_t to, int64_t stride, int64_t D) {
  for (int64_t i = from; i < std::min(to, rows.count); ++i) {
    const char* row = reinterpret_cast<const char*>(cache + rows.slots[i] * stride + rows.offset);
    for (int64_t byte = 0; byte < D * int64_t(sizeof(T)); byte += 64) pagoda::prefetch_line_into_l2(row + byte);
  }
}

// One (sequence, kv head) task; C = D / 16 vector chunks per head; KV the cache's element (T, int8_t or fp8_e4m3).
// `next`: the rows this thread reads next. scores: [G, L] scratch; row_scales: [2 L] scratch (int8's key and value
// scales of the task's rows).
template <typename T, typename KV, int C>
void attend_task(const T* q, const KVCacheView& cache, const int64_t* slots, int64_t first, int64_t len, T* out,
                 int64_t G, int64_t KVH, int64_t kvh, float scale, float softcap, float* scores, float* row_scales,
                 const TaskRows& next) {
  constexpr int64_t D = 16 * C;
  constexpr bool kPerToken = std::is_same_v<KV, int8_t>;
  const KV* k_cache = static_cast<const KV*>(cache.k);
  const KV* v_cache = static_cast<const KV*>(cache.v);
  const int64_t n = len - first;
  const int64_t stride = KVH * D;  // elements between consecutive slots
  const TaskRows own{slots + first, n, kvh * D};
  float* key_scales = row_scales;
  float* value_scales = row_scales + n;
  if constexpr (kPerToken) {
    for (int64_t i = 0; i < n; ++i) {
      key_scales[i] = cache.k_scales[slots[first + i] * KVH + kvh];
      value_scales[i] = cache.v_scales[slots[first + i] * KVH + kvh];
    }
  }
  scale *= cache.k_scale;
  auto prefetch_block = [&](int64_t from, int64_t to) {  // as the first head scores keys [from, to)
    prefetch_rows(v_cache, own, from, to, stride, D);
    prefetch_rows(k_cache, next, from, to, stride, D);
    prefetch_rows(v_cache, next, from, to, stride, D);
  };
  // The scaled queries, and the task's keys widened to fp32 once per block of 16 (an fp32 cache is read in place):
  // every head of the group scores the block from L1, instead of widening each key once per head.
  alignas(64) float queries[kMaxGroup * D];
  for (int64_t e = 0; e < G * D; e += 16) _mm512_store_ps(queries + e, _mm512_mul_ps(load16(q + e), _mm512_set1_ps(scale)));
  int64_t i = 0;
  if constexpr (kPerToken && C % 2 == 0) {
    score_int8_keys<C>(queries, k_cache, slots + first, n, stride, kvh * D, key_scales, G, scores, prefetch_block,
                       next.count);
  } else {
    alignas(64) float tile[16 * D];
    auto widened = [&](int64_t i, int j) -> const float* {  // key i of the task, as fp32 (j: its row in the tile)
      const KV* key = k_cache + slots[first + i] * stride + kvh * D;
      if constexpr (std::is_same_v<KV, float>) {
        return key;
      } else {
        for (int c = 0; c < C; ++c) _mm512_store_ps(tile + j * D + c * 16, load16(key + c * 16));
        return tile + j * D;
      }
    };
    for (; i + 16 <= n; i += 16) {
      prefetch_block(i, i + 16);
      const float* keys[16];
      for (int j = 0; j < 16; ++j) keys[j] = widened(i + j, j);
      for (int64_t g = 0; g < G; ++g) {
        __m512 query[C];
        for (int c = 0; c < C; ++c) query[c] = _mm512_load_ps(queries + g * D + c * 16);
        __m512 partial[16];
        for (int j = 0; j < 16; ++j) {
          __m512 acc = _mm512_mul_ps(query[0], _mm512_loadu_ps(keys[j]));
          for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(keys[j] + c * 16), acc);
          partial[j] = acc;
        }
        __m512 block = transpose_sum16(partial);
        if constexpr (kPerToken) block = _mm512_mul_ps(block, _mm512_loadu_ps(key_scales + i));
        _mm512_storeu_ps(scores + g * n + i, block);
      }
    }
    prefetch_block(i, std::max(n, next.count));  // the tail, and the rest of a longer next task
    for (; i < n; ++i) {
      const float* key = widened(i, 0);
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(_mm512_load_ps(queries + g * D), _mm512_loadu_ps(key));
        for (int c = 1; c < C; ++c)
          acc = _mm512_fmadd_ps(_mm512_load_ps(queries + g * D + c * 16), _mm512_loadu_ps(key + c * 16), acc);
        scores[g * n + i] = _mm512_reduce_add_ps(acc);
        if constexpr (kPerToken) scores[g * n + i] *= key_scales[i];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * n;
    if (softcap > 0) pagoda::simd::soft_cap(row, n, softcap);
    // Softmax weights in place: exp(score - max), and their sum.
    __m512 maxv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (i = 0; i + 16 <= n; i += 16) maxv = _mm512_max_ps(maxv, _mm512_loadu_ps(row + i));
    float max_score = _mm512_reduce_max_ps(maxv);
    for (; i < n; ++i) max_score = std::max(max_score, row[i]);
    __m512 total = _mm512_setzero_ps();
    for (i = 0; i < n; i += 16) {
      const __mmask16 live = i + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
      __m512 w = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, row + i), _mm512_set1_ps(max_score)));
      w = _mm512_maskz_mov_ps(live, w);
      total = _mm512_add_ps(total, w);
      _mm512_mask_storeu_ps(row + i, live, w);
    }
    const float inv_total = cache.v_scale / _mm512_reduce_add_ps(total);
    if constexpr (kPerToken) {
      for (i = 0; i < n; ++i) row[i] *= inv_total * value_scales[i];
    } else {
      for (i = 0; i < n; ++i) row[i] *= inv_total;
    }
  }
  // Weighted sum of values: each value row is loaded once and used by all G heads.
  __m512 acc[kMaxGroup][C];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const KV* value = v_cache + slots[first + i] * stride + kvh * D;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(value + c * 16);
    for (int64_t g = 0; g < G; ++g) {
      __m512 w = _mm512_set1_ps(scores[g * n + i]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) float buffer[D];
    for (int c = 0; c < C; ++c) _mm512_store_ps(buffer + c * 16, acc[g][c]);
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(buffer[d]);
  }
}

template <typename T, typename KV, int C>
void attend(const T* q, const KVCacheView& cache, const int64_t* slots, const int64_t* seq_lens, T* out, int64_t B,
            int64_t H, int64_t KVH, int64_t L, int64_t window, float scale, float softcap) {
  constexpr int64_t D = 16 * C;
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * L + 16);
    std::vector<float> row_scales(std::is_same_v<KV, int8_t> ? 2 * L + 16 : 0);
    auto first_key = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0; };
    auto rows_of = [&](int64_t task) {
      if (task >= end) return TaskRows{};
      const int64_t b = task / KVH, first = first_key(b);
      return TaskRows{slots + b * L + first, seq_lens[b] - first, (task % KVH) * D};
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t head = b * H + kvh * G;
      attend_task<T, KV, C>(q + head * D, cache, slots + b * L, first_key(b), seq_lens[b], out + head * D, G, KVH,
                            kvh, scale, softcap, scores.data(), row_scales.data(), rows_of(task + 1));
    }
  });
}

template <typename T, typename KV>
void dispatch_head_dim(int64_t D, const T* q, const KVCacheView& cache, const int64_t* slots, const int64_t* lens,
                       T* out, int64_t B, int64_t H, int64_t KVH, int64_t L, int64_t window, float scale,
                       float softcap) {
  switch (D / 16) {
    case 1: return attend<T, KV, 1>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 2: return attend<T, KV, 2>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 3: return attend<T, KV, 3>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 4: return attend<T, KV, 4>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 5: return attend<T, KV, 5>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 6: return attend<T, KV, 6>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 7: return attend<T, KV, 7>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case 8: return attend<T, KV, 8>(q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    default: TORCH_CHECK(false, "head_dim must be 16..128, a multiple of 16");
  }
}

template <typename T>
void dispatch_format(int64_t D, const T* q, const KVCacheView& cache, const int64_t* slots, const int64_t* lens,
                     T* out, int64_t B, int64_t H, int64_t KVH, int64_t L, int64_t window, float scale,
                       float softcap) {
  switch (cache.format) {
    case KVFormat::kModel:
      return dispatch_head_dim<T, T>(D, q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case KVFormat::kInt8:
      return dispatch_head_dim<T, int8_t>(D, q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
    case KVFormat::kFp8:
      return dispatch_head_dim<T, fp8_e4m3>(D, q, cache, slots, lens, out, B, H, KVH, L, window, scale, softcap);
  }
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& seq_lens, int64_t window, double scale,
                                     const std::optional<torch::Tensor>& k_scale,
                                     const std::optional<torch::Tensor>& v_scale, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q [B,H,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "fp32 or bf16 only");
  const KVCacheView cache = pagoda::kv_cache_view(k_cache, v_cache, k_scale, v_scale, q.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 slots and lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kMaxGroup, "query heads per kv head: a divisor, at most 16");
  TORCH_CHECK(D % 16 == 0 && D <= 128 && k_cache.size(2) == D, "head_dim must be 16..128, a multiple of 16");
  TORCH_CHECK(slots.size(0) == B && seq_lens.size(0) == B, "one slot row and length per sequence");
  auto qc = q.contiguous();
  auto slot_rows = slots.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t L = slot_rows.size(1);
  if (q.scalar_type() == at::kFloat) {
    dispatch_format<float>(D, qc.data_ptr<float>(), cache, slot_rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                           out.data_ptr<float>(), B, H, KVH, L, window, static_cast<float>(scale),
                           static_cast<float>(softcap));
  } else {
    dispatch_format<at::BFloat16>(D, qc.data_ptr<at::BFloat16>(), cache, slot_rows.data_ptr<int64_t>(),
                                  lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, H, KVH, L, window,
                                  static_cast<float>(scale), static_cast<float>(softcap));
  }
  return out;
}
