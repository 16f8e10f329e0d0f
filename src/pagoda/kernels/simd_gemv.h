// Small-batch matrix-vector kernels for decode, written once over cpu_simd.h's vector (the torch-free core of
// simd_gemv.cpp, the portable modules' gemv_fp32 and gemv_bf16; cpu_gemv.cpp holds the full set's forms):
// y[m, n] = sum_k x[m, k] * W[n, k] for 1..kGemvMaxRows rows of x. At decode each weight is read once a step
// and used for a few rows, so the step is bound by memory: one pass over W, its rows split across threads by the
// caller, and every weight vector loaded once for up to kRowGroup rows of x, in fp32 from registers.
//   fp32 W: fp32 FMAs.
//   bf16 W: widened to fp32 in registers, 2 * kLanes weights from one load by a shift and a mask (bf16 is fp32's
//           upper half), as even and odd elements against x laid out to match (lay_out_pairs); x rounded to
//           bf16 first, as the AVX-512 form's bf16 dot products do; fp32 FMAs. Half of fp32's bytes.
// Up to kStreamedRows rows of x (batch-1 decode, a few streams) is pure streaming, where memory-level parallelism
// is everything: a call's channels are split into kStreams contiguous runs walked side by side, so the core keeps
// kStreams long sequential streams in flight (neighbouring rows side by side are short streams, one row each,
// which the hardware prefetchers follow poorly).
// With more rows the FMAs bound the step, so the register blocking decides: each call copies its channels, a tile
// of ~kTileBytesOfW at a time, into an fp32 tile (stage_tile: read as kStreams runs; bf16 widened into the pair
// layout), which stays in L2 while every group of rows passes over it. bf16 thus runs fp32's blocking: widening
// in the inner loop would take the registers that blocking needs. Either way each output is one row's sum in the
// same order (for bf16 an even element's product, then its odd neighbour's): the same bits for any number of rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

// The accumulators are arrays indexed by loop counters: unrolled before register allocation they live in
// registers; left as loops, GCC keeps the array in memory and stores every accumulator after each FMA.
#define PAGODA_UNROLL _Pragma("GCC unroll 16")

namespace pagoda::simd_kernels {

using simd::kLanes;
using simd::Vec;

// Up to this many rows the blocking below keeps up with torch's fp32 GEMM held to the same instruction set (MKL),
// on bench-125m's linears: in 8 lanes (AVX2, NEON) 1.3x at 64 rows, 1.1x at 256, even at 512; in 16 (AVX-512F)
// 1.3x at 32 rows, 0.85x at 128 (Zen 4). A larger input is a prefill for the GEMM.
constexpr int64_t kGemvMaxRows = kLanes == 16 ? 64 : 512;
constexpr int64_t kGemvKMultiple = 32;  // K's granule: one bf16 step on every target
constexpr int64_t kTileBytesOfW = 256 << 10;
constexpr int kRowGroup = 4;  // rows of x a weight vector serves from registers
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of its loads each weight row is asked into L2
constexpr int64_t kStreamedRows = 4;  // rows of x up to which the channels stream as kStreams runs
constexpr int kStreams = 4;

// Weight rows a step loads for M rows of x: R * M sums, R weight vectors and one x vector stay within AVX2's 16
// registers; with one or two rows of x, R rows are R sequential streams in flight.
template <int M>
constexpr int weight_rows_for() {
  return M <= 2 ? 4 : 3;
}

// How a step reads W: fp32 one vector of kLanes weights; bf16 2 * kLanes weights from one load, split into even
// and odd elements (Vec::load_pairs), against x laid out to match (lay_out_pairs).
template <typename W>
constexpr int64_t kStep = std::is_same_v<W, float> ? kLanes : 2 * kLanes;

// x [M, K] -> out [M, K] with each block of 2 * kLanes as its even elements, then its odd ones: the x layout
// the bf16 GEMV reads.
inline void lay_out_pairs(const float* x, float* out, int64_t M, int64_t K) {
  for (int64_t block = 0; block < M * K; block += 2 * kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      out[block + j] = x[block + 2 * j];
      out[block + kLanes + j] = x[block + 2 * j + 1];
    }
}

// R weight rows (the first at `rows`, then every `stride` elements) against M rows of x:
// y[m * N + r * y_stride] = weight row r . row m of x.
template <typename W, int M, int R>
void weight_rows(const float* x, const W* rows, int64_t stride, int64_t K, float* y, int64_t N, int64_t y_stride) {
  constexpr int64_t kStepsPerLine = std::max<int64_t>(1, 64 / (kStep<W> * int64_t(sizeof(W))));
  Vec sums[R * M];
  PAGODA_UNROLL
  for (int i = 0; i < R * M; ++i) sums[i] = Vec::zero();
  for (int64_t k = 0, step = 0; k < K; k += kStep<W>, ++step) {
    if (step % kStepsPerLine == 0) {
      PAGODA_UNROLL
      for (int r = 0; r < R; ++r) simd::prefetch_line_into_l2(rows + r * stride + k + kPrefetchBytes / sizeof(W));
    }
    if constexpr (std::is_same_v<W, float>) {
      Vec weights[R];
      PAGODA_UNROLL
      for (int r = 0; r < R; ++r) weights[r] = Vec::load(rows + r * stride + k);
      PAGODA_UNROLL
      for (int m = 0; m < M; ++m) {
        const Vec xv = Vec::load(x + m * K + k);
        PAGODA_UNROLL
        for (int r = 0; r < R; ++r) sums[r * M + m] = fmadd(weights[r], xv, sums[r * M + m]);
      }
    } else {
      Vec even[R], odd[R];
      PAGODA_UNROLL
      for (int r = 0; r < R; ++r) Vec::load_pairs(rows + r * stride + k, even[r], odd[r]);
      PAGODA_UNROLL
      for (int m = 0; m < M; ++m) {
        const Vec x_even = Vec::load(x + m * K + k), x_odd = Vec::load(x + m * K + k + kLanes);
        PAGODA_UNROLL
        for (int r = 0; r < R; ++r) sums[r * M + m] = fmadd(odd[r], x_odd, fmadd(even[r], x_even, sums[r * M + m]));
      }
    }
  }
  PAGODA_UNROLL
  for (int r = 0; r < R; ++r)
    PAGODA_UNROLL
    for (int m = 0; m < M; ++m) y[m * N + r * y_stride] = sums[r * M + m].reduce_add();
}

// Channels [begin, end) of W against M rows of x.
template <typename W, int M>
void channel_range(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  constexpr int R = weight_rows_for<M>();
  int64_t n = begin;
  for (; n + R <= end; n += R) weight_rows<W, M, R>(x, w + n * K, K, K, y + n, N, 1);
  for (; n < end; ++n) weight_rows<W, M, 1>(x, w + n * K, K, K, y + n, N, 1);
}

// Channels [begin, end) as kStreams contiguous runs walked side by side (M <= kStreamedRows), the rows of x in
// pairs: a pair's sums and the runs' weight vectors fill the registers, and the second pair finds the weights
// in L1.
template <typename W>
void channel_runs(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t begin,
                  int64_t end) {
  const int64_t run = (end - begin) / kStreams;
  for (int64_t n = begin; n < begin + run; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) weight_rows<W, 2, kStreams>(x + m * K, w + n * K, run * K, K, y + m * N + n, N, run);
    if (m < M) weight_rows<W, 1, kStreams>(x + m * K, w + n * K, run * K, K, y + m * N + n, N, run);
  }
  for (int64_t n = begin + kStreams * run; n < end; ++n)
    for (int64_t m = 0; m < M; ++m) weight_rows<W, 1, 1>(x + m * K, w + n * K, K, K, y + m * N + n, N, 1);
}

// One weight vector's worth (kStep<W> elements) into fp32: bf16 in the pair layout of lay_out_pairs.
template <typename W>
void widen_step(const W* w, float* out) {
  if constexpr (std::is_same_v<W, float>) {
    Vec::load(w).store(out);
  } else {
    Vec even, odd;
    Vec::load_pairs(w, even, odd);
    even.store(out);
    odd.store(out + kLanes);
  }
}

// `rows` rows of W into fp32 (bf16 in the pair layout), read as kStreams runs side by side: the tile's one pass
// over memory, at the streams' bandwidth.
template <typename W>
void stage_tile(const W* w, float* out, int64_t rows, int64_t K) {
  const int64_t run = rows / kStreams * K;
  constexpr int64_t kStepsPerLine = std::max<int64_t>(1, 64 / (kStep<W> * int64_t(sizeof(W))));
  for (int64_t i = 0, step = 0; i < run; i += kStep<W>, ++step) {
    if (step % kStepsPerLine == 0) {
      PAGODA_UNROLL
      for (int s = 0; s < kStreams; ++s) simd::prefetch_line_into_l2(w + s * run + i + kPrefetchBytes / sizeof(W));
    }
    PAGODA_UNROLL
    for (int s = 0; s < kStreams; ++s) widen_step(w + s * run + i, out + s * run + i);
  }
  for (int64_t i = kStreams * run; i < rows * K; i += kStep<W>) widen_step(w + i, out + i);
}

// Channels [0, count) of fp32 W (a tile) against every row of x, kRowGroup rows at a time.
inline void row_groups(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t count) {
  static_assert(kRowGroup == 4, "the dispatch below names each group size");
  for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
    const float* rows = x + m0 * K;
    float* out = y + m0 * N;
    switch (std::min<int64_t>(kRowGroup, M - m0)) {
      case 1: channel_range<float, 1>(rows, w, out, K, N, 0, count); break;
      case 2: channel_range<float, 2>(rows, w, out, K, N, 0, count); break;
      case 3: channel_range<float, 3>(rows, w, out, K, N, 0, count); break;
      default: channel_range<float, 4>(rows, w, out, K, N, 0, count); break;
    }
  }
}

// Channels [begin, end) of y[M, N] = x[M, K] . W[N, K]^T: x in fp32 (laid out by lay_out_pairs for bf16 W),
// 1 <= M <= kGemvMaxRows, K a multiple of kGemvKMultiple. Disjoint channel ranges may run on separate threads.
template <typename W>
void gemv_channels(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t begin,
                   int64_t end) {
  if (M <= kStreamedRows) return channel_runs(x, w, y, M, K, N, begin, end);
  const int64_t tile = std::max<int64_t>(16, kTileBytesOfW / (K * int64_t(sizeof(float))));
  thread_local std::vector<float> staged;
  staged.resize(std::max<size_t>(staged.size(), size_t(tile * K)));
  for (int64_t n0 = begin; n0 < end; n0 += tile) {
    const int64_t count = std::min(end, n0 + tile) - n0;
    stage_tile(w + n0 * K, staged.data(), count, K);
    row_groups(x, staged.data(), y + n0, M, K, N, count);
  }
}

}  // namespace pagoda::simd_kernels
