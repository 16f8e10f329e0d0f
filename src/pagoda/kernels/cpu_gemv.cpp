// Small-batch matrix-vector kernels for decode on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * W[n, k].
//
// At decode time each weight is read once per step and used for only a few rows, so the step is
// bound by memory bandwidth. Stock torch streams bf16 and int8 weights at a fraction of the fp32
// rate; these kernels read them at full speed: one pass over W, rows of W split across threads with
// at::parallel_for; up to 3 rows of x walk several runs of W at once (gemv_streamed), more go a group
// at a time (block_float, block_int8).
//   fp32 W: fp32 FMAs (torch's fp32 GEMV streams at ~0.4-0.6 of the bandwidth floor on these shapes).
//   bf16 W: x rounded to bf16, _mm512_dpbf16_ps (32 products per instruction, fp32 accumulation).
//   int8 W: per-output-channel scales; x quantized to int16 per 128-element block, int8 widened to int16,
//           vpdpwssd (32 products per instruction, exact int32 sums), each block's sum scaled into fp32.
// Blocking for more rows (for_each_block), so that W comes from memory once and x from L1: each thread's
// channels go in tiles of ~256 KB of weights (they stay in L2 while every group of rows passes over
// them), K in chunks whose slice of x (a group's rows) fits in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kMaxRows = 64;             // larger inputs are matrix multiplications: use a GEMM
constexpr int64_t kGrain = 64;               // output channels per parallel task
constexpr int64_t kChunkBytesOfX = 32 << 10;  // the slice of x one pass reads: about L1 (32-48 KB)
// A thread's channels are walked in tiles of this many bytes of W, each tile visited by every group of
// rows before the next: one group after another over the thread's whole range re-read W from L3 or
// memory once per group (1.07x at 32 rows of bench-125m's fp32 linears).
constexpr int64_t kTileBytesOfW = 256 << 10;

inline void prefetch_into_l2(const void* p, int bytes) {
  for (int offset = 0; offset < bytes; offset += 64) pagoda::prefetch_line_into_l2(static_cast<const char*>(p) + offset);
}

// The streamed GEMV's pattern (gemv_streamed): kStreams runs of rows, each prefetched this far ahead.
constexpr int kStreams = 4;
constexpr int64_t kPrefetchBytes = 2048;

// S weight rows (the first at `rows`, then every `stride` elements) against M rows of x (K apart), walked
// side by side: y[m * N + s * run] = weight row s . row m of x. A row is summed block by block (Dot::block(K)
// elements: the whole row for float weights; int8 sums integers over short blocks, each then scaled by its
// block of x: row m's scales start at x_scales + m * blocks_per_row).
template <typename Dot, int S, int M>
void dot_rows(const typename Dot::X* x, const float* x_scales, int64_t blocks_per_row, const typename Dot::W* rows,
              int64_t stride, int64_t K, float* y, int64_t N, int64_t run) {
  using W = typename Dot::W;
  constexpr int64_t kElementsPerLine = 64 / sizeof(W), kPrefetchElements = kPrefetchBytes / sizeof(W);
  const int64_t block = Dot::block(K);
  __m512 total[S * M];
  for (int i = 0; i < S * M; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    typename Dot::Sum partial[S * M];
    for (int i = 0; i < S * M; ++i) partial[i] = Dot::zero();
    for (int64_t k = k0; k < std::min(K, k0 + block); k += Dot::kStep) {
      if (Dot::kPrefetch && k % kElementsPerLine == 0) {
        for (int s = 0; s < S; ++s) prefetch_into_l2(rows + s * stride + k + kPrefetchElements, 64);
      }
      decltype(Dot::load_w(rows)) wv[S];
      for (int s = 0; s < S; ++s) {
        wv[s] = Dot::load_w(rows + s * stride + k);
        if constexpr (M > 1) asm("" : "+v"(wv[s]));  // one load for the M rows (GCC would fold one into each)
      }
      for (int m = 0; m < M; ++m) {
        const auto xv = Dot::load_x(x + m * K + k);
        for (int s = 0; s < S; ++s) partial[s * M + m] = Dot::dot(partial[s * M + m], wv[s], xv);
      }
    }
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m)
        total[s * M + m] = Dot::accumulate(total[s * M + m], partial[s * M + m], x_scales + m * blocks_per_row,
                                           k0 / block);
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < M; ++m) y[m * N + s * run] = _mm512_reduce_add_ps(total[s * M + m]);
}

// Up to kStreamedRows rows of x (batch-1 decode, a speculative step's few rows): pure streaming, where
// memory-level parallelism is the whole game. The thread's channels are split into kStreams contiguous
// runs walked side by side, so one load of x serves kStreams weight rows and the core keeps kStreams long
// sequential streams in flight, each also prefetched kPrefetchBytes ahead into L2; every weight vector
// serves the M rows of x. Walking the rows one at a time, bench-1b's fp32 linears streamed at ~0.8 of the
// best streaming read when the host gave ~55 GB/s (0.68 for the 22 KB rows of down_proj, where x no longer
// stays in L1); 4 runs: ~0.95; with the prefetch: ~1.0. (1, 2, 6 or 8 runs, and prefetching 4 KB ahead,
// measured slower.) At 2-3 rows this streamed bench-1b's linears 3-9% faster than the blocked form
// (block_float); at 4 it was even, and from 5 slower (4 runs of M rows no longer fit the registers).
constexpr int kStreamedRows = 3;

template <typename Dot, int M>
void gemv_streamed(const typename Dot::X* x, const float* x_scales, int64_t blocks_per_row, const typename Dot::W* w,
                   float* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    const int64_t run = (end - begin) / kStreams;
    for (int64_t n = begin; n < begin + run; ++n) {
      dot_rows<Dot, kStreams, M>(x, x_scales, blocks_per_row, w + n * K, run * K, K, y + n, N, run);
    }
    for (int64_t n = begin + kStreams * run; n < end; ++n) {
      dot_rows<Dot, 1, M>(x, x_scales, blocks_per_row, w + n * K, 0, K, y + n, N, 0);
    }
  });
}

// A float weight row is one fp32 sum (block = K; no scales).
struct FloatSum {
  using Sum = __m512;
  static int64_t block(int64_t K) { return K; }
  static __m512 zero() { return _mm512_setzero_ps(); }
  static __m512 accumulate(__m512 total, __m512 partial, const float*, int64_t) { return _mm512_add_ps(total, partial); }
};

struct Fp32Dot : FloatSum {
  using X = float;
  using W = float;
  static constexpr int kStep = 16;
  static constexpr bool kPrefetch = true;
  static __m512 load_x(const float* x) { return _mm512_loadu_ps(x); }
  static __m512 load_w(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 dot(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

struct Bf16Dot : FloatSum {
  using X = at::BFloat16;
  using W = at::BFloat16;
  static constexpr int kStep = 32;
  static constexpr bool kPrefetch = true;
  static __m512bh load_x(const at::BFloat16* x) { return (__m512bh)_mm512_loadu_si512(x); }
  static __m512bh load_w(const at::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static __m512 dot(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
};

// int8 weights against x quantized to int16 per block of kQuantBlock (quantize_blocks): 32 products a
// vpdpwssd, summed exactly in int32 (a block's lane sum stays below 2^26), each block's sum then scaled
// to float by its x scale. Widening int8 to fp32 instead (two converts and an FMA per 16 weights) bound
// the batch-1 GEMV at ~40 GB/s; this is one widen and one dot product per 32.
constexpr int64_t kQuantBlock = 128;

struct Int8Dot {
  using X = int16_t;
  using W = int8_t;
  using Sum = __m512i;
  static constexpr int kStep = 32;
  static constexpr bool kPrefetch = false;
  static int64_t block(int64_t) { return kQuantBlock; }
  static __m512i zero() { return _mm512_setzero_si512(); }
  static __m512i load_x(const int16_t* x) { return _mm512_loadu_si512(x); }
  static __m512i load_w(const int8_t* w) {  // widened to int16
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static __m512i dot(__m512i acc, __m512i w, __m512i x) { return _mm512_dpwssd_epi32(acc, w, x); }
  static __m512 accumulate(__m512 total, __m512i partial, const float* x_scales, int64_t block) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(partial), _mm512_set1_ps(x_scales[block]), total);
  }
};

// x [K] -> int16 q with one scale per kQuantBlock elements: q = round(x / scale), scale = max|x| / 32767
// over the block, so every element keeps ~15 bits relative to its block's largest (bf16 keeps 8): an
// outlier costs precision only in its own block. A block of zeros (or denormals) gets scale 0.
template <typename T>
void quantize_blocks(const T* x, int64_t K, int16_t* q, float* scales) {
  for (int64_t k0 = 0; k0 < K; k0 += kQuantBlock) {
    const int64_t k1 = std::min(K, k0 + kQuantBlock);
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(pagoda::load16(x + k)));
    const float largest = _mm512_reduce_max_ps(amax);
    const bool tiny = largest < 1e-30f;
    scales[k0 / kQuantBlock] = tiny ? 0.0f : largest / 32767.0f;
    const __m512 inverse = _mm512_set1_ps(tiny ? 0.0f : 32767.0f / largest);
    for (int64_t k = k0; k < k1; k += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(pagoda::load16(x + k), inverse));  // to nearest
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtsepi32_epi16(rounded));
    }
  }
}

// More rows of x against float W: R weight rows at a time against M rows of x (M <= kFloatRowGroup, R * M
// = 16 independent sums, half the registers), each weight vector loaded once for the M rows and each x
// vector once for the R weight rows. One weight row against 8 rows of x took 18 loads per 16 FMAs, and
// Zen 4 issues one 512-bit load a cycle; with R = 16 / M, bench-125m's linears (2 threads) ran 1.1x (8
// rows), 1.25x (16) and 1.3x (32) faster in fp32, 1.1x, 1.17x and 1.25x in bf16 (4 rows of bf16: 0.94x).
// The weights kFarRows rows ahead are prefetched into L2: the first group over a tile streams them from
// memory, and a row of FMAs is shorter than DRAM's latency.
constexpr int kFloatRowGroup = 8;
constexpr int64_t kFarRows = 8;

// One step of kStep elements: R weight rows' vectors loaded once, each x row's vector once, and
// sums[r * M + m] += weight row r . row m of x.
template <typename Dot, int M, int R>
__attribute__((always_inline)) inline void weight_rows_step(const typename Dot::X* x, const typename Dot::W* rows,
                                                            int64_t K, int64_t k, typename Dot::Sum* sums) {
  decltype(Dot::load_w(rows)) wv[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    pagoda::prefetch_line_into_l2(rows + (kFarRows + r) * K + k);
    wv[r] = Dot::load_w(rows + r * K + k);
    asm("" : "+v"(wv[r]));  // keep the operands in registers: GCC folds a load into each product that uses
  }                         // it, loading every vector R or M times
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    auto xv = Dot::load_x(x + m * K + k);
    asm("" : "+v"(xv));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sums[r * M + m] = Dot::dot(sums[r * M + m], wv[r], xv);
  }
}

template <typename Dot, int M, int R>
void weight_rows(const typename Dot::X* x, const typename Dot::W* rows, float* y, int64_t K, int64_t N, int64_t k0,
                 int64_t k1) {
  __m512 acc[R * M];  // acc[r * M + m]: weight row r against row m of x
#pragma GCC unroll 32
  for (int i = 0; i < R * M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += Dot::kStep) weight_rows_step<Dot, M, R>(x, rows, K, k, acc);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) y[m * N + r] += _mm512_reduce_add_ps(acc[r * M + m]);
}

template <typename Dot, int M>
void block_float(const typename Dot::X* x, const typename Dot::W* w, float* y, int64_t K, int64_t N, int64_t begin,
                 int64_t end, int64_t k0, int64_t k1) {
  constexpr int R = std::min(4, 16 / M);
  int64_t n = begin;
  for (; n + R <= end; n += R) weight_rows<Dot, M, R>(x, w + n * K, y + n, K, N, k0, k1);
  for (; n < end; ++n) weight_rows<Dot, M, 1>(x, w + n * K, y + n, K, N, k0, k1);
}

// More rows of x (M <= kInt8RowGroup) against int8 W: R weight rows at a time (R * M integer sums), each
// block of 32 weights widened once, then one vpdpwssd per row of x; every kQuantBlock, each row's integer
// sums are scaled by that block of x into fp32 (as Int8Dot does). One weight row at a time left only M
// independent sums, a chain of dependent vpdpwssd: 2 rows of x ran at half the one-row rate.
constexpr int kInt8RowGroup = 8;

template <int M, int R>
void int8_weight_rows(const int16_t* x, const float* x_scales, int64_t blocks_per_row, const int8_t* rows, float* y,
                      int64_t K, int64_t N, int64_t k0, int64_t k1) {
  __m512 acc[R * M];  // acc[r * M + m]: weight row r against row m of x
#pragma GCC unroll 32
  for (int i = 0; i < R * M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b0 = k0; b0 < k1; b0 += kQuantBlock) {
    __m512i partial[R * M];
#pragma GCC unroll 32
    for (int i = 0; i < R * M; ++i) partial[i] = _mm512_setzero_si512();
    for (int64_t k = b0; k < std::min(k1, b0 + kQuantBlock); k += Int8Dot::kStep) {
      weight_rows_step<Int8Dot, M, R>(x, rows, K, k, partial);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 scale = _mm512_set1_ps(x_scales[m * blocks_per_row + b0 / kQuantBlock]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r * M + m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(partial[r * M + m]), scale,
                                                                 acc[r * M + m]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) y[m * N + r] += _mm512_reduce_add_ps(acc[r * M + m]);
}

template <int M>
void block_int8(const int16_t* x, const float* x_scales, int64_t blocks_per_row, const int8_t* w, float* y, int64_t K,
                int64_t N, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
  constexpr int R = std::max(1, std::min(4, 8 / M));  // R * M sums and R * M totals: 16 of the 32 registers
  int64_t n = begin;
  for (; n + R <= end; n += R) int8_weight_rows<M, R>(x, x_scales, blocks_per_row, w + n * K, y + n, K, N, k0, k1);
  for (; n < end; ++n) int8_weight_rows<M, 1>(x, x_scales, blocks_per_row, w + n * K, y + n, K, N, k0, k1);
}

// body(std::integral_constant<int, rows>) for rows in 1..Max: the row count as a compile-time constant.
template <int Max, typename Body>
void dispatch_rows(int64_t rows, Body body) {
  if constexpr (Max > 1) {
    if (rows < Max) return dispatch_rows<Max - 1>(rows, body);
  }
  body(std::integral_constant<int, Max>{});
}

// For M > 1: block(m0, rows, begin, end, k0, k1) over each thread's channels in tiles of ~kTileBytesOfW of
// W, K in chunks whose slice of x (a group of up to `group` rows, x_bytes an element) fits in L1, and
// within them the rows `group` at a time.
template <typename Body>
void for_each_block(int64_t M, int64_t K, int64_t N, int64_t group, int64_t x_bytes, int64_t w_bytes,
                    int64_t k_align, Body block) {
  const int64_t chunk = std::max<int64_t>(k_align, kChunkBytesOfX / (std::min(M, group) * x_bytes) / k_align * k_align);
  const int64_t tile = std::max<int64_t>(16, kTileBytesOfW / (std::min(K, chunk) * w_bytes));
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += tile) {
      const int64_t n1 = std::min(end, n0 + tile);
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t k1 = std::min(K, k0 + chunk);
        for (int64_t m0 = 0; m0 < M; m0 += group) block(m0, std::min(group, M - m0), n0, n1, k0, k1);
      }
    }
  });
}

// y[M, N] = x[M, K] . W[N, K]^T for float W and M > 1, blocked as the header says.
template <typename Dot>
void gemv(const typename Dot::X* x, const typename Dot::W* w, float* y, int64_t M, int64_t K, int64_t N) {
  std::fill(y, y + M * N, 0.0f);
  for_each_block(M, K, N, kFloatRowGroup, sizeof(typename Dot::X), sizeof(typename Dot::W), Dot::kStep,
                 [&](int64_t m0, int64_t rows, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
                   dispatch_rows<kFloatRowGroup>(rows, [&](auto group) {
                     block_float<Dot, decltype(group)::value>(x + m0 * K, w, y + m0 * N, K, N, begin, end, k0, k1);
                   });
                 });
}

void check_shapes(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1..", kMaxRows, " rows");
  TORCH_CHECK(w.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

}  // namespace

// y = x @ w.T, accumulated in float32, for x of any float dtype (converted to Dot::X) and float w of
// Dot::W: one row through the streaming path, more through block_float. The caller casts the result to
// x's dtype (inside one op call: bf16 decode runs ~150 linears a step).
template <typename Dot>
torch::Tensor run_gemv(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType x_type, at::ScalarType w_type) {
  using X = typename Dot::X;
  using W = typename Dot::W;
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == w_type, "w must be ", w_type);
  auto xc = x.to(x_type).contiguous();
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M <= kStreamedRows) {
    dispatch_rows<kStreamedRows>(M, [&](auto rows) {
      gemv_streamed<Dot, decltype(rows)::value>(xc.data_ptr<X>(), nullptr, 0, w.data_ptr<W>(), y.data_ptr<float>(), K,
                                                N);
    });
  } else {
    gemv<Dot>(xc.data_ptr<X>(), w.data_ptr<W>(), y.data_ptr<float>(), M, K, N);
  }
  return y;
}

int64_t gemv_max_rows() { return kMaxRows; }

torch::Tensor gemv_fp32(const torch::Tensor& x, const torch::Tensor& w) {
  return run_gemv<Fp32Dot>(x, w, at::kFloat, at::kFloat).to(x.scalar_type());
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  return run_gemv<Bf16Dot>(x, w, at::kBFloat16, at::kBFloat16).to(x.scalar_type());
}

// x, each row quantized to int16 blocks (quantize_blocks), against int8 W: one row through Int8Dot's
// streaming path, more through block_int8.
torch::Tensor gemv_int8_rows(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0), blocks = (K + kQuantBlock - 1) / kQuantBlock;
  auto xc = x.contiguous();
  auto q = torch::empty({M, K}, x.options().dtype(at::kShort));
  auto x_scales = torch::empty({M, blocks}, x.options().dtype(at::kFloat));
  int16_t* qp = q.data_ptr<int16_t>();
  float* sp = x_scales.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    if (xc.scalar_type() == at::kBFloat16) {
      quantize_blocks(xc.data_ptr<at::BFloat16>() + m * K, K, qp + m * K, sp + m * blocks);
    } else {
      quantize_blocks(xc.to(at::kFloat).data_ptr<float>() + m * K, K, qp + m * K, sp + m * blocks);
    }
  }
  const int8_t* wp = w.data_ptr<int8_t>();
  if (M <= kStreamedRows) {
    auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
    dispatch_rows<kStreamedRows>(M, [&](auto rows) {
      gemv_streamed<Int8Dot, decltype(rows)::value>(qp, sp, blocks, wp, y.data_ptr<float>(), K, N);
    });
    return y;
  }
  auto y = torch::zeros({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  for_each_block(M, K, N, kInt8RowGroup, sizeof(int16_t), sizeof(int8_t), kQuantBlock,
                 [&](int64_t m0, int64_t rows, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
                   dispatch_rows<kInt8RowGroup>(rows, [&](auto group) {
                     block_int8<decltype(group)::value>(qp + m0 * K, sp + m0 * blocks, blocks, wp, yp + m0 * N, K,
                                                        N, begin, end, k0, k1);
                   });
                 });
  return y;
}

// scale: [N] float32, per output channel: applied once per output, not per weight.
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "scale must be float32 [N]");
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8");
  return gemv_int8_rows(x, w).mul_(scale.contiguous()).to(x.scalar_type());
}
