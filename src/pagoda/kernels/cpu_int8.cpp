// int8 weights (per-output-channel scales, codes in -127..127: model/quantization.py's Int8Linear) against any
// number of rows of x, for CPUs without the AVX-512 set the full kernels need (those run cpu_gemv.cpp's
// gemv_int8, whose x carries 15 bits): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k], x quantized to int8 per 32
// columns (simd_int.h's int8_row_dots, in an AVX2 and a NEON form). One row streams W at memory's rate; at
// prefill sizes the integer products outrun fp32 GEMMs on dequantized tiles.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_ops.h"
#include "cpu_x_codes.h"

namespace {

using pagoda::int_kernels::kInt8Group;
constexpr int64_t kGrain = 16;  // output channels per parallel task

}  // namespace

torch::Tensor matmul_int8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M >= 1, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
  TORCH_CHECK(K % kInt8Group == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "scale must be float32 [N]");
  const pagoda::XCodes xq(x, kInt8Group);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  // Within a pass, each weight row stays in L1 while every row of x passes over it.
  for (int64_t m0 = 0; m0 < M; m0 += pagoda::kRowsPerPass) {
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        pagoda::for_row_groups(m0, std::min(M, m0 + pagoda::kRowsPerPass), [&](auto count, int64_t m) {
          pagoda::int_kernels::int8_row_dots<decltype(count)::value>(wp + n * K, xq.row_codes(m), xq.row_scales(m), K,
                                                                     N, yp + m * N + n);
        });
      }
    });
  }
  return y.mul_(scale.contiguous()).to(x.scalar_type());
}
