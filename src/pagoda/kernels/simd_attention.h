// Paged decode attention written once over cpu_simd.h's vector: the torch-free core of simd_attention.cpp (the
// AVX2 module's paged_decode_attention; cpu_attention.cpp holds the AVX-512 form, with the same contract): one
// query token per sequence, keys and values read in place from the paged cache through each sequence's slot list.
//
// q: [B, H, D]; k_cache, v_cache: [num_slots, KVH, D] (fp32 or bf16); slots: [B, L] int64 (padded);
// seq_lens: [B] int64; window: 0 for none, else keys at positions >= seq_len - window.
// Work is split over (sequence, kv head) tasks; each handles the G = H / KVH query heads sharing that kv head,
// so every key and value row is read from memory once and used G times. Scores, the softmax and the weighted
// sum are in fp32; the scaled query and the G heads' sums live in a task buffer in L1 (AVX2's 16 registers
// hold neither at D = 128).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace pagoda::simd_kernels {

using simd::kLanes;
using simd::Vec;

constexpr int kMaxGroup = 16;  // query heads per kv head, as the AVX-512 form takes
constexpr int64_t kMaxHeadDim = 128;

// Scratch of one thread: scores [G, L], the scaled queries [G, D] and the weighted sums [G, D].
struct Scratch {
  std::vector<float> scores, queries, sums;
  Scratch(int64_t G, int64_t L, int64_t D) : scores(G * L), queries(G * D), sums(G * D) {}
};

// One (sequence, kv head) task: keys [first, len) of the sequence's slots.
template <typename T>
void attend_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t first, int64_t len,
                 T* out, int64_t G, int64_t KVH, int64_t kvh, int64_t D, float scale, Scratch& scratch) {
  const int64_t n = len - first, stride = KVH * D;
  auto row_of = [&](const T* cache, int64_t i) { return cache + slots[first + i] * stride + kvh * D; };
  float* queries = scratch.queries.data();
  for (int64_t e = 0; e < G * D; e += kLanes) (Vec::load(q + e) * Vec::broadcast(scale)).store(queries + e);
  for (int64_t g = 0; g < G; ++g) {
    float* row = scratch.scores.data() + g * n;
    const float* query = queries + g * D;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const T* key = row_of(k_cache, i);
      Vec acc = Vec::load(query) * Vec::load(key);
      for (int64_t d = kLanes; d < D; d += kLanes) acc = fmadd(Vec::load(query + d), Vec::load(key + d), acc);
      row[i] = acc.reduce_add();
      max_score = std::max(max_score, row[i]);
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
    const float inv_total = 1.0f / total.reduce_add();
    for (i = 0; i < n; ++i) row[i] *= inv_total;
  }
  // Weighted sum of values: each value row is read once and used by all G heads.
  float* sums = scratch.sums.data();
  std::fill(sums, sums + G * D, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const T* value = row_of(v_cache, i);
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

// Tasks [begin, end) of the B * KVH (sequence, kv head) tasks; disjoint ranges may run on separate threads.
// H / KVH <= kMaxGroup; D a multiple of 16, at most kMaxHeadDim.
template <typename T>
void attend_tasks(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const int64_t* seq_lens,
                  T* out, int64_t H, int64_t KVH, int64_t L, int64_t D, int64_t window, float scale, int64_t begin,
                  int64_t end) {
  const int64_t G = H / KVH;
  Scratch scratch(G, L, D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / KVH, kvh = task % KVH;
    const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[b] - window) : 0;
    const int64_t head = b * H + kvh * G;
    attend_task<T>(q + head * D, k_cache, v_cache, slots + b * L, first, seq_lens[b], out + head * D, G, KVH, kvh, D,
                   scale, scratch);
  }
}

}  // namespace pagoda::simd_kernels
