// What the integer matmuls (cpu_int4.cpp, cpu_int8.cpp) share: x quantized per group to int8 (simd_int.h's
// quantize_row), and the walk over rows of x in passes and groups.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd_int.h"

namespace pagoda {

// x [M, K] as int8 codes with, per group of `group` columns, a scale and the sum of the group's codes
// (int_kernels::quantize_row).
struct XCodes {
  torch::Tensor codes, scales, sums;  // int8 [M, K], float [M, K / group], int32 [M, K / group]
  int64_t groups;
  // The tensors' data, read once: data_ptr is an out-of-line call into torch, too slow for a kernel's inner loops.
  const int8_t* code_data;
  const float* scale_data;
  const int32_t* sum_data;

  XCodes(const torch::Tensor& x, int64_t group) : groups(x.size(1) / group) {
    const int64_t M = x.size(0), K = x.size(1);
    auto xf = x.to(at::kFloat).contiguous();
    codes = torch::empty({M, K}, x.options().dtype(at::kChar));
    scales = torch::empty({M, groups}, x.options().dtype(at::kFloat));
    sums = torch::empty({M, groups}, x.options().dtype(at::kInt));
    const float* xp = xf.data_ptr<float>();
    int8_t* cp = codes.data_ptr<int8_t>();
    float* sp = scales.data_ptr<float>();
    int32_t* up = sums.data_ptr<int32_t>();
    code_data = cp;
    scale_data = sp;
    sum_data = up;
    // Rows are independent; a decode's few rows stay on the calling thread.
    at::parallel_for(0, M, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        int_kernels::quantize_row(xp + m * K, K, group, cp + m * K, sp + m * groups, up + m * groups);
    });
  }

  const int8_t* row_codes(int64_t m) const { return code_data + m * codes.size(1); }
  const float* row_scales(int64_t m) const { return scale_data + m * groups; }
  const int32_t* row_sums(int64_t m) const { return sum_data + m * groups; }

 private:
  static constexpr int64_t kRowsPerTask = 16;
};

// Rows of x whose codes stay in L2 while the weights pass over them, kRowGroup at a time.
constexpr int64_t kRowsPerPass = 64;
constexpr int kRowGroup = 4;

// rows(std::integral_constant<int, R>, m) over rows m0..m1 of x: R = kRowGroup while that many remain, then
// 2, then 1, so the count of rows a weight load serves is a compile-time constant.
template <typename Rows>
inline void for_row_groups(int64_t m0, int64_t m1, Rows rows) {
  int64_t m = m0;
  for (; m + kRowGroup <= m1; m += kRowGroup) rows(std::integral_constant<int, kRowGroup>{}, m);
  for (; m + 2 <= m1; m += 2) rows(std::integral_constant<int, 2>{}, m);
  for (; m < m1; ++m) rows(std::integral_constant<int, 1>{}, m);
}

}  // namespace pagoda
