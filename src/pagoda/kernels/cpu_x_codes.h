// What the integer matmuls (cpu_int4.cpp, cpu_int8.cpp) share: x quantized per group to int8, and the walk
// over rows of x in passes and groups. Written for AVX2.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace pagoda {

// x [M, K] as int8 codes with, per group of `group` columns, a scale (max|x| / 127; codes round to nearest)
// and the sum of the group's codes. A group of zeros gets scale 0 and codes 0.
struct XCodes {
  torch::Tensor codes, scales, sums;  // int8 [M, K], float [M, K / group], int32 [M, K / group]
  int64_t groups;

  XCodes(const torch::Tensor& x, int64_t group) : groups(x.size(1) / group) {
    const int64_t M = x.size(0), K = x.size(1);
    auto xf = x.to(at::kFloat).contiguous();
    codes = torch::empty({M, K}, x.options().dtype(at::kChar));
    scales = torch::empty({M, groups}, x.options().dtype(at::kFloat));
    sums = torch::empty({M, groups}, x.options().dtype(at::kInt));
    for (int64_t m = 0; m < M; ++m) {
      quantize_row(xf.data_ptr<float>() + m * K, K, group, codes.data_ptr<int8_t>() + m * K,
                   scales.data_ptr<float>() + m * groups, sums.data_ptr<int32_t>() + m * groups);
    }
  }

  const int8_t* row_codes(int64_t m) const { return codes.data_ptr<int8_t>() + m * codes.size(1); }
  const float* row_scales(int64_t m) const { return scales.data_ptr<float>() + m * groups; }
  const int32_t* row_sums(int64_t m) const { return sums.data_ptr<int32_t>() + m * groups; }

 private:
  static void quantize_row(const float* x, int64_t K, int64_t group, int8_t* codes, float* scales, int32_t* sums) {
    for (int64_t g0 = 0; g0 < K; g0 += group) {
      float largest = 0.0f;
      for (int64_t k = g0; k < g0 + group; ++k) largest = std::max(largest, std::fabs(x[k]));
      const float scale = largest / 127.0f;
      int32_t sum = 0;
      for (int64_t k = g0; k < g0 + group; ++k) {
        const int32_t code = scale > 0.0f ? static_cast<int32_t>(std::nearbyint(x[k] / scale)) : 0;
        codes[k] = static_cast<int8_t>(std::clamp(code, -127, 127));
        sum += codes[k];
      }
      scales[g0 / group] = scale;
      sums[g0 / group] = sum;
    }
  }
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
