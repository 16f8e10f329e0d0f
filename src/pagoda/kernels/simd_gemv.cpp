// The torch binding of simd_gemv.h's GEMV (the AVX2 module's gemv_fp32, gemv_bf16 and gemv_int8): checks,
// x's conversion and layout, and the channels split across threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "cpu_ops.h"
#include "simd_gemv.h"
#include "simd_tensors.h"

namespace {

namespace kernels = pagoda::simd_kernels;

constexpr int64_t kGrain = 16;  // output channels per parallel task

void check_shapes(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kernels::kGemvMaxRows, "x must have 1..", kernels::kGemvMaxRows,
              " rows");
  TORCH_CHECK(w.size(1) % kernels::kGemvKMultiple == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

// y = x @ w.T accumulated in fp32, in x's dtype; x is rounded to `x_type` first.
template <typename W>
torch::Tensor run_gemv(const torch::Tensor& x, const torch::Tensor& w, at::ScalarType x_type) {
  check_shapes(x, w);
  TORCH_CHECK(w.scalar_type() == c10::CppTypeToScalarType<W>::value, "w must be ",
              c10::CppTypeToScalarType<W>::value);
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  auto xf = x.to(x_type).to(at::kFloat).contiguous();
  if constexpr (!std::is_same_v<W, float>) {
    auto laid_out = torch::empty_like(xf);
    kernels::lay_out_pairs(xf.data_ptr<float>(), laid_out.data_ptr<float>(), M, K);
    xf = laid_out;
  }
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* x_data = xf.data_ptr<float>();
  const auto* w_data = kernels::core_data<W>(w);
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    kernels::gemv_channels(x_data, w_data, y_data, M, K, N, begin, end);
  });
  return y.to(x.scalar_type());
}

}  // namespace

int64_t gemv_max_rows() { return kernels::kGemvMaxRows; }

torch::Tensor gemv_fp32(const torch::Tensor& x, const torch::Tensor& w) { return run_gemv<float>(x, w, at::kFloat); }

torch::Tensor gemv_bf16(const torch::Tensor& x, const torch::Tensor& w) {
  return run_gemv<at::BFloat16>(x, w, at::kBFloat16);
}

// Without AVX-512 the int8 GEMV is the integer matmul (x as int8 per 32 columns), so that the native decode
// stack and the int8 layers (which run matmul_int8) compute the same sums.
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  check_shapes(x, w);
  return matmul_int8(x, w, scale);
}
