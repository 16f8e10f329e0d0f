// int8 weights (per-output-channel scales, codes in -127..127: model/quantization.py's Int8Linear) against any
// number of rows of x, for CPUs without the AVX-512 set the full kernels need (those run cpu_gemv.cpp's
// gemv_int8, whose x carries 15 bits): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// As llama.cpp's q8_0 does, x is quantized to int8 per 32 columns, so that 32 products are one vpmaddubsw:
// it multiplies unsigned by signed bytes, hence |q| against x with q's sign (vpsignb), pair sums at most
// 2 * 127 * 127 < 2^15. Each group's 8 int32 lanes are scaled by the group's x scale into fp32. One row
// streams W at memory's rate; at prefill sizes the integer products outrun fp32 GEMMs on dequantized tiles.
// The result is exactly (up to fp32 summation order) W times x's dequantized codes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "cpu_x_codes.h"

namespace {

constexpr int64_t kGroup = 32;  // columns of x sharing a scale: one 32-byte load
constexpr int64_t kGrain = 16;  // output channels per parallel task

inline float sum_lanes(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

// One weight row (K codes) against R rows of x (codes[r * K], scales[r * groups]): out[r * N] = the row's dot
// product with row r, before the channel's scale.
template <int R>
void row_dots(const int8_t* w, const int8_t* codes, const float* x_scales, int64_t K, int64_t N, float* out) {
  const int64_t groups = K / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kGroup) {
    const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i magnitude = _mm256_sign_epi8(weights, weights);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * K + k));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, weights));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));  // exact: |.| < 2^17
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(x_scales[r * groups + k / kGroup]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = sum_lanes(acc[r]);
}

}  // namespace

torch::Tensor matmul_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M >= 1, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "scale must be float32 [N]");
  const pagoda::XCodes xq(x, kGroup);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  // Within a pass, each weight row stays in L1 while every row of x passes over it.
  for (int64_t m0 = 0; m0 < M; m0 += pagoda::kRowsPerPass) {
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        pagoda::for_row_groups(m0, std::min(M, m0 + pagoda::kRowsPerPass), [&](auto count, int64_t m) {
          row_dots<decltype(count)::value>(wp + n * K, xq.row_codes(m), xq.row_scales(m), K, N, yp + m * N + n);
        });
      }
    });
  }
  return y.mul_(scale.contiguous()).to(x.scalar_type());
}
