// Paged decode attention written once over cpu_simd.h's vector: the torch-free core of simd_attention.cpp (the
// AVX2 module's paged_decode_attention; cpu_attention.cpp holds the AVX-512 form, with the same contract): one
// query token per sequence, keys and values read in place from the paged cache through each sequence's slot list.
//
// q: [B, H, D]; the cache (kv_quant.h's view): K, V [num_slots, KVH, D] in q's dtype, int8 codes with their
// scales [num_slots, KVH], or e4m3 codes with the layer's scales; slots: [B, L] int64 (padded); seq_lens: [B]
// int64; window: 0 for none, else keys at positions >= seq_len - window; softcap: 0 for none, else each score s
// becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). Codes are widened to fp32 in registers:
// a key's score is its codes' dot product times its scale, a value's weight is its probability times its scale
// (fp8's layer scales fold into the query's scale and the normalisation), so nothing is dequantized to memory.
// Work is split over (sequence, kv head) tasks; each handles the G = H / KVH query heads sharing that kv head,
// so every key and value row is read from memory once and used G times. Scores, the softmax and the weighted
// sum are in fp32; the scaled query and the G heads' sums live in a task buffer in L1 (AVX2's 16 registers
// hold neither at D = 128).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "kv_quant.h"

namespace pagoda::simd_kernels {

using simd::fp8_e4m3;
using simd::kLanes;
using simd::Vec;

constexpr int kMaxGroup = 16;  // query heads per kv head, as the AVX-512 form takes
constexpr int64_t kMaxHeadDim = 128;

// Scratch of one thread: scores [G, L], the scaled queries [G, D], the weighted sums [G, D], and int8's key and
// value scales of the task's rows [L] each.
struct Scratch {
  std::vector<float> scores, queries, sums, key_scales, value_scales;
  Scratch(int64_t G, int64_t L, int64_t D) : scores(G * L), queries(G * D), sums(G * D), key_scales(L), value_scales(L) {}
};

// One (sequence, kv head) task: keys [first, len) of the sequence's slots. KV: the cache's element (T, int8_t or
// fp8_e4m3).
template <typename T, typename KV>
void attend_task(const T* q, const kv_quant::KVCacheView& cache, const int64_t* slots, int64_t first, int64_t len,
                 T* out, int64_t G, int64_t KVH, int64_t kvh, int64_t D, float scale, float softcap, Scratch& scratch) {
  const int64_t n = len - first, stride = KVH * D;
  const KV* k_cache = static_cast<const KV*>(cache.k);
  const KV* v_cache = static_cast<const KV*>(cache.v);
  auto row_of = [&](const KV* rows, int64_t i) { return rows + slots[first + i] * stride + kvh * D; };
  constexpr bool kPerToken = std::is_same_v<KV, int8_t>;
  if constexpr (kPerToken) {
    for (int64_t i = 0; i < n; ++i) {
      scratch.key_scales[i] = cache.k_scales[slots[first + i] * KVH + kvh];
      scratch.value_scales[i] = cache.v_scales[slots[first + i] * KVH + kvh];
    }
  }
  float* queries = scratch.queries.data();
  const Vec query_scale = Vec::broadcast(scale * cache.k_scale);
  for (int64_t e = 0; e < G * D; e += kLanes) (Vec::load(q + e) * query_scale).store(queries + e);
  for (int64_t g = 0; g < G; ++g) {
    float* row = scratch.scores.data() + g * n;
    const float* query = queries + g * D;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const KV* key = row_of(k_cache, i);
      Vec acc = Vec::load(query) * Vec::load(key);
      for (int64_t d = kLanes; d < D; d += kLanes) acc = fmadd(Vec::load(query + d), Vec::load(key + d), acc);
      row[i] = acc.reduce_add();
      if constexpr (kPerToken) row[i] *= scratch.key_scales[i];
      max_score = std::max(max_score, row[i]);
    }
    if (softcap > 0) {  // the capped scores' max, as the softmax below sees them
      simd::soft_cap(row, n, softcap);
      max_score = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n; ++i) max_score = std::max(max_score, row[i]);
    }
    // Softmax weights in place: exp(score - max), then divided by their sum.
    Vec total = Vec::zero();
    const Vec shift = Vec::broadcast(max_score);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const Vec w = simd::exp_nonpositive(Vec::load(row + i) - shift);
      total = total + w;
      w.store(row + i);
    }
    if (i < n) {
      const Vec w = simd::exp_nonpositive(simd::load_first(row + i, n - i) - shift);
      simd::store_first(row + i, w, n - i);
      total = total + simd::load_first(row + i, n - i);  // the padding lanes stay out of the sum
    }
    const float inv_total = cache.v_scale / total.reduce_add();
    if constexpr (kPerToken) {
      for (i = 0; i < n; ++i) row[i] *= inv_total * scratch.value_scales[i];
    } else {
      for (i = 0; i < n; ++i) row[i] *= inv_total;
    }
  }
  // Weighted sum of values: each value row is read once and used by all G heads.
  float* sums = scratch.sums.data();
  std::fill(sums, sums + G * D, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const KV* value = row_of(v_cache, i);
    for (int64_t d = 0; d < D; d += kLanes) {
      const Vec v = Vec::load(value + d);
      for (int64_t g = 0; g < G; ++g) {
        float* sum = sums + g * D + d;
        fmadd(Vec::broadcast(scratch.scores[g * n + i]), v, Vec::load(sum)).store(sum);
      }
    }
  }
  for (int64_t e = 0; e < G * D; e += kLanes) Vec::load(sums + e).store(out + e);
}

// Calls body(KV{}) with KV the cache's element type: T (the model's dtype), int8_t or fp8_e4m3.
template <typename T, typename Body>
void dispatch_kv_format(kv_quant::KVFormat format, Body body) {
  switch (format) {
    case kv_quant::KVFormat::kModel: return body(T{});
    case kv_quant::KVFormat::kInt8: return body(int8_t{});
    case kv_quant::KVFormat::kFp8: return body(fp8_e4m3{});
  }
}

// Tasks [begin, end) of the B * KVH (sequence, kv head) tasks; disjoint ranges may run on separate threads.
// H / KVH <= kMaxGroup; D a multiple of 16, at most kMaxHeadDim.
template <typename T, typename KV>
void attend_tasks(const T* q, const kv_quant::KVCacheView& cache, const int64_t* slots, const int64_t* seq_lens,
                  T* out, int64_t H, int64_t KVH, int64_t L, int64_t D, int64_t window, float scale, float softcap,
                  int64_t begin, int64_t end) {
  const int64_t G = H / KVH;
  Scratch scratch(G, L, D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / KVH, kvh = task % KVH;
    const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
    const int64_t head = b * H + kvh * G;
    attend_task<T, KV>(q + head * D, cache, slots + b * L, first, seq_lens[b], out + head * D, G, KVH, kvh, D,
                       scale, softcap, scratch);
  }
}

}  // namespace pagoda::simd_kernels
