// Small-batch matrix-vector kernels for decode on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * W[n, k].
//
// At decode time each weight is read once per step and used for only a few rows, so the step is
// bound by memory bandwidth. Stock torch streams bf16 and int8 weights at a fraction of the fp32
// rate; these kernels read them at full speed: one pass over W, rows of W split across threads with
// at::parallel_for; one row of x walks several runs of W at once (gemv_one_row), more rows go 8 at a time.
//   fp32 W: fp32 FMAs (torch's fp32 GEMV streams at ~0.4-0.6 of the bandwidth floor on these shapes).
//   bf16 W: x rounded to bf16, _mm512_dpbf16_ps (32 products per instruction, fp32 accumulation).
//   int8 W: per-output-channel scales; x quantized to int16 per 128-element block, int8 widened to int16,
//           vpdpwssd (32 products per instruction, exact int32 sums), each block's sum scaled into fp32.
// Blocking, so that x never streams from L2 once per weight row: each thread's tile of output channels
// walks K in chunks whose slice of x (all rows of a group) fits in L1, and more than 8 rows are taken
// 8 at a time over the same chunk of weights (hot in L2), so W still comes from memory once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <optional>

#include "cpu_ops.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kRowGroup = 8;             // rows of x per pass (accumulators held in registers)
constexpr int64_t kMaxRows = 64;             // larger inputs are matrix multiplications: use a GEMM
constexpr int64_t kGrain = 64;               // output channels per parallel task
constexpr int64_t kChunkBytesOfX = 32 << 10;  // the slice of x one pass reads: about L1 (32-48 KB)

// The same columns of the next weight row, a whole row's compute ahead of their use: with several rows
// of x the loop is busy with FMAs and issues its loads late; the hardware prefetcher alone then leaves
// the core waiting on memory (at 8 rows, 4x below the in-cache rate).
inline void prefetch_next_row(const void* p, int bytes) {
  for (int offset = 0; offset < bytes; offset += 64) pagoda::prefetch_line_into_l1(static_cast<const char*>(p) + offset);
}

// With several rows of x, also the row kFarRows ahead into L2: a row of FMAs is shorter than DRAM's
// latency, so with only the next row prefetched, memory and compute took turns (8 rows of x ran at the
// sum of their in-cache and streaming times; with this, 1.3x faster at 8 rows, 1.1x at 32). int8's
// widening makes it compute-bound at several rows, where this measured no different.
constexpr int64_t kFarRows = 8;
inline void prefetch_into_l2(const void* p, int bytes) {
  for (int offset = 0; offset < bytes; offset += 64) pagoda::prefetch_line_into_l2(static_cast<const char*>(p) + offset);
}

// One pass: rows [0, M) of x (row stride K) against channels [begin, end) of W over k in [k0, k1).
// Partial sums are added into y (row stride N).
template <int M>
void block_fp32(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t begin, int64_t end,
                int64_t k0, int64_t k1) {
  for (int64_t n = begin; n < end; ++n) {
    const float* row = w + n * K;
    __m512 acc0[M], acc1[M];  // two FMA chains per row of x: one alone would be latency-bound
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 32) {
      if constexpr (M > 1) {
        prefetch_next_row(row + K + k, 128);
        prefetch_into_l2(row + kFarRows * K + k, 128);
      }
      __m512 w0 = _mm512_loadu_ps(row + k), w1 = _mm512_loadu_ps(row + k + 16);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc0[m]);
        acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc1[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] += _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

template <int M>
void block_bf16(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t K, int64_t N, int64_t begin,
                int64_t end, int64_t k0, int64_t k1) {
  for (int64_t n = begin; n < end; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      if constexpr (M > 1) {
        prefetch_next_row(row + K + k, 128);
        prefetch_into_l2(row + kFarRows * K + k, 128);
      }
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
      }
    }
    if (k < k1) {  // K is a multiple of 32, not always of 64
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m) acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] += _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

// The batch-1 GEMV's pattern (gemv_one_row): kStreams runs of rows, each prefetched this far ahead.
constexpr int kStreams = 4;
constexpr int64_t kPrefetchBytes = 2048;

// S weight rows (the first at `rows`, then every `stride` elements) against one row of x, walked side by
// side: sums[s] = row s . x. The row is summed block by block (Dot::block(K) elements: the whole row for
// float weights; int8 sums integers over short blocks, each then scaled by its block of x).
template <typename Dot, int S>
void dot_rows(const typename Dot::X* x, const float* x_scales, const typename Dot::W* rows, int64_t stride,
              int64_t K, float* sums, int64_t sums_stride) {
  using W = typename Dot::W;
  constexpr int64_t kElementsPerLine = 64 / sizeof(W), kPrefetchElements = kPrefetchBytes / sizeof(W);
  const int64_t block = Dot::block(K);
  __m512 total[S];
  for (int s = 0; s < S; ++s) total[s] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    typename Dot::Sum partial[S];
    for (int s = 0; s < S; ++s) partial[s] = Dot::zero();
    for (int64_t k = k0; k < std::min(K, k0 + block); k += Dot::kStep) {
      const auto xv = Dot::load_x(x + k);
      if (Dot::kPrefetch && k % kElementsPerLine == 0) {
        for (int s = 0; s < S; ++s) prefetch_into_l2(rows + s * stride + k + kPrefetchElements, 64);
      }
      for (int s = 0; s < S; ++s) partial[s] = Dot::dot(partial[s], rows + s * stride + k, xv);
    }
    for (int s = 0; s < S; ++s) total[s] = Dot::accumulate(total[s], partial[s], x_scales, k0 / block);
  }
  for (int s = 0; s < S; ++s) sums[s * sums_stride] = _mm512_reduce_add_ps(total[s]);
}

// One row of x (batch-1 decode): pure streaming, where memory-level parallelism is the whole game. The
// thread's channels are split into kStreams contiguous runs walked side by side, so one load of x
// serves kStreams weight rows and the core keeps kStreams long sequential streams in flight, each also
// prefetched kPrefetchBytes ahead into L2. Walking the rows one at a time, bench-1b's fp32 linears
// streamed at ~0.8 of the best streaming read when the host gave ~55 GB/s (0.68 for the 22 KB rows of
// down_proj, where x no longer stays in L1); 4 runs: ~0.95; with the prefetch: ~1.0. (1, 2, 6 or 8
// runs, and prefetching 4 KB ahead, measured slower.)
template <typename Dot>
void gemv_one_row(const typename Dot::X* x, const float* x_scales, const typename Dot::W* w, float* y, int64_t K,
                  int64_t N) {
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    const int64_t run = (end - begin) / kStreams;
    for (int64_t n = begin; n < begin + run; ++n) dot_rows<Dot, kStreams>(x, x_scales, w + n * K, run * K, K, y + n, run);
    for (int64_t n = begin + kStreams * run; n < end; ++n) dot_rows<Dot, 1>(x, x_scales, w + n * K, 0, K, y + n, 0);
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
  static __m512 dot(__m512 acc, const float* w, __m512 x) { return _mm512_fmadd_ps(_mm512_loadu_ps(w), x, acc); }
};

struct Bf16Dot : FloatSum {
  using X = at::BFloat16;
  using W = at::BFloat16;
  static constexpr int kStep = 32;
  static constexpr bool kPrefetch = true;
  static __m512bh load_x(const at::BFloat16* x) { return (__m512bh)_mm512_loadu_si512(x); }
  static __m512 dot(__m512 acc, const at::BFloat16* w, __m512bh x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), x);
  }
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
  static __m512i dot(__m512i acc, const int8_t* w, __m512i x) {
    return _mm512_dpwssd_epi32(acc, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), x);
  }
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

// More rows of x against int8 W: each weight block of 32 widened once, then one vpdpwssd a row of x;
// every kQuantBlock, each row's integer sums are scaled by that block of x into fp32 (as Int8Dot does).
template <int M>
void block_int8(const int16_t* x, const float* x_scales, int64_t blocks_per_row, const int8_t* w, float* y, int64_t K,
                int64_t N, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b0 = k0; b0 < k1; b0 += kQuantBlock) {
      __m512i partial[M];
      for (int m = 0; m < M; ++m) partial[m] = _mm512_setzero_si512();
      for (int64_t k = b0; k < std::min(k1, b0 + kQuantBlock); k += 32) {
        const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)));
        for (int m = 0; m < M; ++m) {
          partial[m] = _mm512_dpwssd_epi32(partial[m], w16, _mm512_loadu_si512(x + m * K + k));
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 scale = _mm512_set1_ps(x_scales[m * blocks_per_row + b0 / kQuantBlock]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(partial[m]), scale, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] += _mm512_reduce_add_ps(acc[m]);
  }
}

// Calls block<rows>(...) with rows (1..8) as a compile-time constant.
template <template <int> class Block, typename... Args>
void dispatch_rows(int64_t rows, Args... args) {
  switch (rows) {
    case 1: return Block<1>::run(args...);
    case 2: return Block<2>::run(args...);
    case 3: return Block<3>::run(args...);
    case 4: return Block<4>::run(args...);
    case 5: return Block<5>::run(args...);
    case 6: return Block<6>::run(args...);
    case 7: return Block<7>::run(args...);
    default: return Block<8>::run(args...);
  }
}

template <int M> struct Fp32 {
  template <typename... A> static void run(A... a) { block_fp32<M>(a...); }
};
template <int M> struct Bf16 {
  template <typename... A> static void run(A... a) { block_bf16<M>(a...); }
};
template <int M> struct Int8 {
  template <typename... A> static void run(A... a) { block_int8<M>(a...); }
};

// For M > 1: block(m0, rows, begin, end, k0, k1) over each thread's tile of channels, K in chunks whose
// slice of x (a group of up to 8 rows, x_bytes an element) fits in L1, and the rows 8 at a time.
template <typename Body>
void for_each_block(int64_t M, int64_t K, int64_t N, int64_t x_bytes, int64_t k_align, Body block) {
  const int64_t group = std::min(M, kRowGroup);
  const int64_t chunk = std::max<int64_t>(k_align, kChunkBytesOfX / (group * x_bytes) / k_align * k_align);
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t k1 = std::min(K, k0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) block(m0, std::min(kRowGroup, M - m0), begin, end, k0, k1);
    }
  });
}

// y[M, N] = x[M, K] . W[N, K]^T for float W and M > 1, blocked as the header says.
template <template <int> class Block, typename X, typename W>
void gemv(const X* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  std::fill(y, y + M * N, 0.0f);
  for_each_block(M, K, N, sizeof(X), 64,
                 [&](int64_t m0, int64_t rows, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
                   dispatch_rows<Block>(rows, x + m0 * K, w, y + m0 * N, K, N, begin, end, k0, k1);
                 });
}

void check_shapes(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1..64 rows");
  TORCH_CHECK(w.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

}  // namespace

// y = x @ w.T, accumulated in float32, for x of any float dtype (converted to X) and float w of dtype W:
// one row through OneRow's streaming path, more through Block's. The caller casts the result to x's dtype
// (inside one op call: bf16 decode runs ~150 linears a step).
template <typename OneRow, template <int> class Block, typename X, typename W>
torch::Tensor run_gemv(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType x_type, at::ScalarType w_type) {
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == w_type, "w must be ", w_type);
  auto xc = x.to(x_type).contiguous();
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 1) {
    gemv_one_row<OneRow>(xc.data_ptr<X>(), nullptr, w.data_ptr<W>(), y.data_ptr<float>(), K, N);
  } else {
    gemv<Block>(xc.data_ptr<X>(), w.data_ptr<W>(), y.data_ptr<float>(), M, K, N);
  }
  return y;
}

torch::Tensor gemv_fp32(const torch::Tensor& x, const torch::Tensor& w) {
  return run_gemv<Fp32Dot, Fp32, float, float>(x, w, at::kFloat, at::kFloat).to(x.scalar_type());
}

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  return run_gemv<Bf16Dot, Bf16, at::BFloat16, at::BFloat16>(x, w, at::kBFloat16, at::kBFloat16).to(x.scalar_type());
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
  if (M == 1) {
    auto y = torch::empty({1, N}, x.options().dtype(at::kFloat));
    gemv_one_row<Int8Dot>(qp, sp, wp, y.data_ptr<float>(), K, N);
    return y;
  }
  auto y = torch::zeros({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  for_each_block(M, K, N, sizeof(int16_t), kQuantBlock,
                 [&](int64_t m0, int64_t rows, int64_t begin, int64_t end, int64_t k0, int64_t k1) {
                   dispatch_rows<Int8>(rows, qp + m0 * K, sp + m0 * blocks, blocks, wp, yp + m0 * N, K, N, begin,
                                       end, k0, k1);
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
