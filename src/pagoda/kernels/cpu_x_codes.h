// What the integer matmuls (cpu_int4.cpp, cpu_int8.cpp) share: x quantized per group to int8, and the walk
// over rows of x in passes and groups. Written for AVX2.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagoda {

// x [M, K] as int8 codes with, per group of `group` columns, a scale (max|x| / 127; codes round to nearest)
// and the sum of the group's codes. A group of zeros gets scale 0 and codes 0.
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
        quantize_row(xp + m * K, K, group, cp + m * K, sp + m * groups, up + m * groups);
    });
  }

  const int8_t* row_codes(int64_t m) const { return code_data + m * codes.size(1); }
  const float* row_scales(int64_t m) const { return scale_data + m * groups; }
  const int32_t* row_sums(int64_t m) const { return sum_data + m * groups; }

 private:
  static constexpr int64_t kRowsPerTask = 16;

  // Eight columns at a time (groups are multiples of 32); the same scale, codes and sums as the scalar rule:
  // division (not a reciprocal) and round-half-to-even, then the clamp.
  static void quantize_row(const float* x, int64_t K, int64_t group, int8_t* codes, float* scales, int32_t* sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
    for (int64_t g0 = 0; g0 < K; g0 += group) {
      __m256 largest = _mm256_setzero_ps();
      // max(|x|, largest): a NaN in x leaves largest as it was, as std::max(largest, |x|) does
      for (int64_t k = g0; k < g0 + group; k += 8)
        largest = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), largest);
      const float scale = horizontal_max(largest) / 127.0f;
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = g0; k < g0 + group; k += 8) {
        __m256i code = _mm256_setzero_si256();
        if (scale > 0.0f) {
          code = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(scale)));
          code = _mm256_min_epi32(_mm256_max_epi32(code, low), high);
        }
        sum = _mm256_add_epi32(sum, code);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k), _mm_packs_epi16(words, words));
      }
      scales[g0 / group] = scale;
      sums[g0 / group] = horizontal_sum(sum);
    }
  }

  static float horizontal_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }

  static int32_t horizontal_sum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
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
