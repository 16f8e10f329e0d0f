// int4 weights against any number of rows of x, decode and prefill alike: y[m, n] = sum_k x[m, k] * W[n, k], W held in torch's CPU
// int4 layout (what model/int4.py stores) with a bf16 (scale, offset) per group of input columns:
// W = (q - 8) * scale + offset, q in 0..15.
//
// Written for AVX2 (it is the whole int4 path on CPUs without AVX-512, and AVX-512 CPUs run it too). As llama.cpp
// does for its 4-bit formats, x is quantized per weight group to int8 (round to nearest, scale max|x| / 127),
// so that the inner loop is integer: vpmaddubsw multiplies 32 unsigned nibbles by 32 signed x codes and adds
// the pairs into 16-bit sums. Widening each nibble to fp32 for an FMA instead costs ~17 instructions per 16
// bytes of weights and bounds a core below memory's rate; this is ~13 per 32 bytes. The result is exactly
// (up to fp32 summation order) W times x's dequantized codes, so the error bound is |W| |x - x_hat|.
// Integer products also keep prefill ahead of dequantizing W into fp32 GEMMs (1.7-2.6x at 64-256 rows on
// bench-1b's shapes, AVX2 Zen 3): 32 multiply-adds an instruction against an fp32 FMA's 8.
//
// The layout: output rows in blocks of 32; within a block, input column after column, 16 bytes a column,
// byte i holding row i (low nibble) and row i + 16 (high). One 32-byte load is two columns of a block; the
// nibbles are rearranged into (column k, column k + 1) pairs per row, the order vpmaddubsw sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_ops.h"
#include "cpu_x_codes.h"

namespace {

constexpr int64_t kBlockRows = 32;  // the layout's block of output rows
// Columns summed in 16-bit lanes before widening to 32 bits: 8 pairs of at most 2 * 15 * 127 stay below 2^15.
constexpr int64_t kColumnsPer16BitSum = 16;

// 32 output rows (one block of the layout, K * 16 bytes at `block`) against R quantized rows of x (codes[r * K],
// the per-group arrays at [r * groups]): y[r * N + n] = sum_g x_scale[g] * (scale[g, n] * (isum[g, n] - 8 *
// code_sum[g]) + offset[g, n] * code_sum[g]), isum[g, n] = sum over the group of q[n, k] * code[k]. The nibbles
// of each pair of columns are rearranged once for all R rows (the rearranging is most of the work).
template <int R>
void block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                const uint32_t* scale_offset, int64_t N, int64_t K, int64_t group, float* y) {
  const int64_t groups = K / group;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][4];  // acc[r][i]: row r of x against output rows 8i..8i+7, in fp32
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    // isum[r][i]: output rows 8i..8i+7; the 16-bit sums hold rows 0-7 | 16-23 (even) and 8-15 | 24-31 (odd).
    __m256i isum[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) isum[r][i] = _mm256_setzero_si256();
    for (int64_t k0 = g0; k0 < g0 + group; k0 += kColumnsPer16BitSum) {
      __m256i even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + kColumnsPer16BitSum; k += 2) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + k * 16));
        const __m256i low = _mm256_and_si256(both, nibble);                           // rows 0-15: k | k+1
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);  // rows 16-31: k | k+1
        const __m256i column = _mm256_permute2x128_si256(low, high, 0x20);          // k: rows 0-15 | 16-31
        const __m256i next = _mm256_permute2x128_si256(low, high, 0x31);            // k+1: rows 0-15 | 16-31
        const __m256i first = _mm256_unpacklo_epi8(column, next), second = _mm256_unpackhi_epi8(column, next);
        for (int r = 0; r < R; ++r) {
          int16_t pair;
          std::memcpy(&pair, codes + r * K + k, sizeof(pair));
          const __m256i x = _mm256_set1_epi16(pair);  // (code[k], code[k+1]) in every 16-bit lane
          even[r] = _mm256_add_epi16(even[r], _mm256_maddubs_epi16(first, x));
          odd[r] = _mm256_add_epi16(odd[r], _mm256_maddubs_epi16(second, x));
        }
      }
      for (int r = 0; r < R; ++r) {
        isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(even[r])));
        isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(odd[r])));
        isum[r][2] = _mm256_add_epi32(isum[r][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(even[r], 1)));
        isum[r][3] = _mm256_add_epi32(isum[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(odd[r], 1)));
      }
    }
    const int64_t g = g0 / group;
    const uint32_t* pairs = scale_offset + g * N;  // this block's 32 (scale, offset) bf16 pairs
    for (int i = 0; i < 4; ++i) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 8 * i));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(packed, 16));
      const __m256 offset = _mm256_castsi256_ps(_mm256_and_si256(packed, high_half));
      for (int r = 0; r < R; ++r) {
        const int32_t code_sum = code_sums[r * groups + g];
        const __m256 centred =  // exact: |isum - 8 * code_sum| < 2^24
            _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r][i], _mm256_set1_epi32(8 * code_sum)));
        const __m256 term = _mm256_fmadd_ps(scale, centred, _mm256_mul_ps(offset, _mm256_set1_ps(code_sum)));
        acc[r][i] = _mm256_fmadd_ps(term, _mm256_set1_ps(x_scales[r * groups + g]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + r * N + 8 * i, acc[r][i]);
}

}  // namespace

torch::Tensor matmul_int4(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales_and_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M >= 1, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K / 2] in torch's CPU int4 layout");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "x and packed disagree on K");
  TORCH_CHECK(N % kBlockRows == 0, "N must be a multiple of 32");
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "the group must be a multiple of 32 dividing K");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == K / group &&
                  scales_and_zeros.size(1) == N && scales_and_zeros.size(2) == 2,
              "scales_and_zeros must be contiguous bf16 [K / group, N, 2]");
  const pagoda::XCodes xq(x, group);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* so = reinterpret_cast<const uint32_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  // Within a pass, each block's weights (K * 16 bytes) stay in L1/L2 while every row passes over them.
  for (int64_t m0 = 0; m0 < M; m0 += pagoda::kRowsPerPass) {
    at::parallel_for(0, N / kBlockRows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        pagoda::for_row_groups(m0, std::min(M, m0 + pagoda::kRowsPerPass), [&](auto count, int64_t m) {
          block_rows<decltype(count)::value>(wp + b * kBlockRows * K / 2, xq.row_codes(m), xq.row_scales(m),
                                             xq.row_sums(m), so + b * kBlockRows, N, K, group,
                                             yp + m * N + b * kBlockRows);
        });
      }
    });
  }
  return y.to(x.scalar_type());
}
