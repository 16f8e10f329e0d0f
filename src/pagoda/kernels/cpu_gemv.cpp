// Small-batch matrix-vector kernels for decode on AVX-512 CPUs: y[m, n] = sum_k x[m, k] * W[n, k].
//
// At decode time each weight is read once per step and used for only a few rows, so the step is
// bound by memory bandwidth. Stock torch streams bf16 and int8 weights at a fraction of the fp32
// rate; these kernels read them at full speed: one pass over W, all M rows of x at once (M <= 8),
// rows of W split across threads with at::parallel_for.
//   bf16 W: x rounded to bf16, _mm512_dpbf16_ps (32 products per instruction, fp32 accumulation).
//   fp32 W: fp32 FMAs (torch's fp32 GEMV streams at ~0.4-0.6 of the bandwidth floor on these shapes).
//   int8 W: per-output-channel scales; int8 -> fp32 in registers, fp32 FMAs, scaled at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kGrain = 64;  // output channels per parallel task

template <int M>
void gemv_bf16_block(const at::BFloat16* x, const at::BFloat16* w, float* y, int64_t K, int64_t N,
                     int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 acc0[M], acc1[M];  // two dot-product chains per row of x, as above
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      __m512bh w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
        acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
      }
    }
    for (; k < K; k += 32) {
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m) acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

template <int M>
void gemv_fp32_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* row = w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512 w0 = _mm512_loadu_ps(row + k), w1 = _mm512_loadu_ps(row + k + 16);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc0[m]);
        acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc1[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
  }
}

template <int M>
void gemv_int8_block(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N,
                     int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = w + n * K;
    // Two accumulators per row of x: one FMA chain alone would be latency-bound.
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(packed)));
      __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(packed, 1)));
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc0[m]);
        acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc1[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) * scale[n];
  }
}

template <typename Block>
void dispatch_rows(int64_t M, Block&& block) {
  switch (M) {
    case 1: block(std::integral_constant<int, 1>{}); break;
    case 2: block(std::integral_constant<int, 2>{}); break;
    case 3: block(std::integral_constant<int, 3>{}); break;
    case 4: block(std::integral_constant<int, 4>{}); break;
    case 5: block(std::integral_constant<int, 5>{}); break;
    case 6: block(std::integral_constant<int, 6>{}); break;
    case 7: block(std::integral_constant<int, 7>{}); break;
    default: block(std::integral_constant<int, 8>{}); break;
  }
}

void check_shapes(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1..8 rows");
  TORCH_CHECK(w.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

}  // namespace

// x: [M, K] (any float dtype), w: [N, K] bf16 -> [M, N] float32.
torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w must be bfloat16");
  auto xb = x.to(at::kBFloat16).contiguous();
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* xp = xb.data_ptr<at::BFloat16>();
  const auto* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    dispatch_rows(M, [&](auto rows) { gemv_bf16_block<decltype(rows)::value>(xp, wp, yp, K, N, begin, end); });
  });
  return y;
}

// x: [M, K] (any float dtype), w: [N, K] float32 -> [M, N] float32.
torch::Tensor gemv_fp32(const torch::Tensor& x, const torch::Tensor& w) {
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "w must be float32");
  auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    dispatch_rows(M, [&](auto rows) { gemv_fp32_block<decltype(rows)::value>(xp, wp, yp, K, N, begin, end); });
  });
  return y;
}

// x: [M, K] (any float dtype), w: [N, K] int8, scale: [N] float32 -> [M, N] float32.
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == w.size(0), "scale must be float32 [N]");
  auto xf = x.to(at::kFloat).contiguous();
  auto sc = scale.contiguous();
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    dispatch_rows(M, [&](auto rows) { gemv_int8_block<decltype(rows)::value>(xp, wp, sp, yp, K, N, begin, end); });
  });
  return y;
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& seq_lens, int64_t window, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence attending to its keys in the paged KV cache (window 0: none)");
  m.def("gemv_fp32", &gemv_fp32, "y = x @ w.T for fp32 w and 1..8 rows of x");
  m.def("gemv_bf16", &gemv_bf16, "y = x @ w.T for bf16 w and 1..8 rows of x (float32 out)");
  m.def("gemv_int8", &gemv_int8, "y = (x @ w.T) * scale for int8 w and 1..8 rows of x (float32 out)");
}
