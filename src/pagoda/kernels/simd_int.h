// The integer matmuls' cores (cpu_int8.cpp, cpu_int4.cpp), torch-free so that tests/native runs them on each
// target: x quantized to int8 per group of columns, and int8 or int4 weight rows against those codes. Each core
// has an AVX2 form (the AVX2 module, and the AVX-512 one where it has no faster form) and a NEON form (aarch64);
// both compute the same integer sums exactly and differ only in the order of their fp32 sums.
//
// As llama.cpp's q8_0 does, x is quantized per 32 (int8) or per weight group (int4) columns: scale max|x| / 127,
// codes rounded to nearest, so that the inner loops multiply bytes. The result is exactly (up to fp32 summation
// order) W times x's dequantized codes, so the error bound is |W| |x - x_hat|.
//
// The int4 layout (model/int4.py's pack_int4): output rows in blocks of 32; within a block, input column after
// column, 16 bytes a column, byte i holding row i (low nibble) and row i + 16 (high); W = (q - 8) * scale + offset,
// q in 0..15, with a bf16 (scale, offset) pair per row and group, block-major [N / 32, K / group, 32, 2]: a block's
// pairs for one group (128 bytes) are followed by its next group's, so a block's scales are a second sequential
// stream beside its weights. (In torch's [K / group, N, 2] a block's next pairs are a row of the array away; that
// stride defeats the prefetchers and held batch-1 decode to 0.3-0.6 of the read bandwidth at group 32, against
// 0.7-0.9 block-major.)
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_simd.h"

namespace pagoda::int_kernels {

using simd::prefetch_line_into_l1;
using simd::prefetch_line_into_l2;

constexpr int64_t kInt8Group = 32;  // columns of x sharing a scale in the int8 matmul: one 32-byte load
constexpr int64_t kBlockRows = 32;  // the int4 layout's block of output rows
// Columns summed in 16-bit lanes before widening to 32 bits: 16 products of at most 15 * 127 stay below 2^15.
constexpr int64_t kColumnsPer16BitSum = 16;
// The pairs of the group this many ahead are prefetched: a block's pairs are only 1/4 of its bytes at group 32, a
// stream too thin for the hardware prefetchers to run ahead of.
constexpr int64_t kPrefetchGroups = 4;
constexpr int64_t kPairBytes = kBlockRows * 4;  // a block's (scale, offset) pairs for one group
// One thread streams one block at a time, a single sequential stream, which the hardware prefetchers alone keep
// well below a core's share of memory bandwidth; software prefetches this far ahead (into the next block at a
// block's end: a thread's blocks are adjacent) keep enough lines in flight.
constexpr int64_t kPrefetchBytes = 2048;

// Where the block-major pairs of block b start (`pairs`: the array's or an earlier block's start), and within a
// block's, those of group g: the layout's one statement of where a pair lives.
inline const uint32_t* block_pairs(const uint32_t* pairs, int64_t b, int64_t groups) {
  return pairs + b * groups * kBlockRows;
}
inline const uint32_t* group_pairs(const uint32_t* block_pairs, int64_t g) { return block_pairs + g * kBlockRows; }

inline void prefetch_pairs(const uint32_t* block_pairs, int64_t g, int64_t groups) {
  if (g >= groups) return;
  const char* pairs = reinterpret_cast<const char*>(group_pairs(block_pairs, g));
  for (int64_t line = 0; line < kPairBytes; line += 64) prefetch_line_into_l1(pairs + line);
}

// One row of x (K columns, K a multiple of `group`, itself a multiple of 8) as int8 codes with, per group, a scale
// (max|x| / 127, NaN ignored) and the sum of the group's codes: codes are x / scale (a division, not a reciprocal)
// rounded half to even and clamped to -127..127. A group of zeros gets scale 0 and codes 0.
inline void quantize_row(const float* x, int64_t K, int64_t group, int8_t* codes, float* scales, int32_t* sums);

// One int8 weight row (K codes) against R rows of x (codes[r * K], x_scales[r * K / 32]): out[r * N] = the row's dot
// product with row r's dequantized codes, before the channel's scale.
template <int R>
void int8_row_dots(const int8_t* w, const int8_t* codes, const float* x_scales, int64_t K, int64_t N, float* out);

// One int4 block of 32 output rows (K * 16 bytes at `block`, its pairs at `pairs`) against R rows of x quantized per
// group (codes[r * K], the per-group arrays at [r * groups]): y[r * N + n] = sum_g x_scale[g] * (scale[g, n] *
// (isum[g, n] - 8 * code_sum[g]) + offset[g, n] * code_sum[g]), isum[g, n] = sum over the group of q[n, k] * code[k].
template <int R>
void int4_block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                     const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y);

#if defined(__AVX2__)

inline float sum_lanes(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline void quantize_row(const float* x, int64_t K, int64_t group, int8_t* codes, float* scales, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m256 largest = _mm256_setzero_ps();
    // max(|x|, largest): a NaN in x leaves largest as it was, as std::max(largest, |x|) does
    for (int64_t k = g0; k < g0 + group; k += 8)
      largest = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), largest);
    const float scale = max_lanes(largest) / 127.0f;
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
    sums[g0 / group] = sum_lanes(sum);
  }
}

// 32 products are one vpmaddubsw: it multiplies unsigned by signed bytes, hence |q| against x with q's sign
// (vpsignb), pair sums at most 2 * 127 * 127 < 2^15. Each group's 8 int32 lanes are scaled by the group's x scale
// into fp32.
template <int R>
void int8_row_dots(const int8_t* w, const int8_t* codes, const float* x_scales, int64_t K, int64_t N, float* out) {
  const int64_t groups = K / kInt8Group;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kInt8Group) {
    const __m256i weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i magnitude = _mm256_sign_epi8(weights, weights);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * K + k));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, weights));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));  // exact: |.| < 2^17
      acc[r] = _mm256_fmadd_ps(sums, _mm256_set1_ps(x_scales[r * groups + k / kInt8Group]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = sum_lanes(acc[r]);
}

// vpmaddubsw multiplies 32 unsigned nibbles by 32 signed x codes and adds the pairs into 16-bit sums: the nibbles
// of each pair of columns are rearranged once for all R rows into (column k, column k + 1) pairs per row (the
// rearranging is most of the work). Widening each nibble to fp32 for an FMA instead costs ~17 instructions per 16
// bytes of weights and bounds a core below memory's rate; this is ~13 per 32 bytes.
template <int R>
void int4_block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                     const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y) {
  const int64_t groups = K / group;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][4];  // acc[r][i]: row r of x against output rows 8i..8i+7, in fp32
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    prefetch_pairs(pairs, g0 / group + kPrefetchGroups, groups);
    // isum[r][i]: output rows 8i..8i+7; the 16-bit sums hold rows 0-7 | 16-23 (even) and 8-15 | 24-31 (odd).
    __m256i isum[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) isum[r][i] = _mm256_setzero_si256();
    for (int64_t k0 = g0; k0 < g0 + group; k0 += kColumnsPer16BitSum) {
      __m256i even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k0 + kColumnsPer16BitSum; k += 2) {
        if (k % 4 == 0) prefetch_line_into_l1(block + k * 16 + kPrefetchBytes);
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
    for (int i = 0; i < 4; ++i) {  // this block's 32 (scale, offset) bf16 pairs for the group
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_pairs(pairs, g) + 8 * i));
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

#elif defined(__aarch64__)

inline void quantize_row(const float* x, int64_t K, int64_t group, int8_t* codes, float* scales, int32_t* sums) {
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    float32x4_t largest = vdupq_n_f32(0.0f);
    // maxNum(|x|, largest): a NaN in x leaves largest as it was, as the AVX2 form's max does
    for (int64_t k = g0; k < g0 + group; k += 4) largest = vmaxnmq_f32(vabsq_f32(vld1q_f32(x + k)), largest);
    const float scale = vmaxvq_f32(largest) / 127.0f;
    int32x4_t sum = vdupq_n_s32(0);
    for (int64_t k = g0; k < g0 + group; k += 8) {
      int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
      if (scale > 0.0f) {  // vcvtnq rounds half to even, as the AVX2 form's conversion under the default rounding
        const float32x4_t divisor = vdupq_n_f32(scale);
        lo = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vdivq_f32(vld1q_f32(x + k), divisor)), vdupq_n_s32(127)),
                       vdupq_n_s32(-127));
        hi = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vdivq_f32(vld1q_f32(x + k + 4), divisor)), vdupq_n_s32(127)),
                       vdupq_n_s32(-127));
      }
      sum = vaddq_s32(sum, vaddq_s32(lo, hi));
      vst1_s8(codes + k, vmovn_s16(vcombine_s16(vmovn_s32(lo), vmovn_s32(hi))));
    }
    scales[g0 / group] = scale;
    sums[g0 / group] = vaddvq_s32(sum);
  }
}

// Byte products widen into 16-bit lanes (vmull/vmlal: two products of at most 127 * 127 each < 2^15), pairwise into
// 32-bit ones, and each group's sums are scaled by the group's x scale into fp32.
template <int R>
void int8_row_dots(const int8_t* w, const int8_t* codes, const float* x_scales, int64_t K, int64_t N, float* out) {
  const int64_t groups = K / kInt8Group;
  float32x4_t acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t k = 0; k < K; k += kInt8Group) {
    const int8x16_t w0 = vld1q_s8(w + k), w1 = vld1q_s8(w + k + 16);
    for (int r = 0; r < R; ++r) {
      const int8x16_t x0 = vld1q_s8(codes + r * K + k), x1 = vld1q_s8(codes + r * K + k + 16);
      const int16x8_t first = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0);
      const int16x8_t second = vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)), w1, x1);
      const int32x4_t sums = vpadalq_s16(vpaddlq_s16(first), second);
      acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(sums), vdupq_n_f32(x_scales[r * groups + k / kInt8Group]));
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = vaddvq_f32(acc[r]);
}

// Each column's 16 bytes are 32 nibbles (rows 0-15 low, 16-31 high), which need only a mask and a shift to be
// bytes; each multiplies the column's broadcast x code into 16-bit sums (vmlal_s8), 16 columns at a time.
template <int R>
void int4_block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                     const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y) {
  const int64_t groups = K / group;
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  float32x4_t acc[R][8];  // acc[r][i]: row r of x against output rows 4i..4i+3, in fp32
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) acc[r][i] = vdupq_n_f32(0.0f);
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    prefetch_pairs(pairs, g0 / group + kPrefetchGroups, groups);
    int32x4_t isum[R][8];  // output rows 4i..4i+3
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 8; ++i) isum[r][i] = vdupq_n_s32(0);
    for (int64_t k0 = g0; k0 < g0 + group; k0 += kColumnsPer16BitSum) {
      int16x8_t part[R][4];  // output rows 8j..8j+7
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) part[r][j] = vdupq_n_s16(0);
      for (int64_t k = k0; k < k0 + kColumnsPer16BitSum; ++k) {
        if (k % 4 == 0) prefetch_line_into_l1(block + k * 16 + kPrefetchBytes);
        const uint8x16_t column = vld1q_u8(block + k * 16);
        const int8x16_t low = vreinterpretq_s8_u8(vandq_u8(column, nibble));  // rows 0-15
        const int8x16_t high = vreinterpretq_s8_u8(vshrq_n_u8(column, 4));    // rows 16-31
        for (int r = 0; r < R; ++r) {
          const int8x16_t x = vdupq_n_s8(codes[r * K + k]);
          part[r][0] = vmlal_s8(part[r][0], vget_low_s8(low), vget_low_s8(x));
          part[r][1] = vmlal_high_s8(part[r][1], low, x);
          part[r][2] = vmlal_s8(part[r][2], vget_low_s8(high), vget_low_s8(x));
          part[r][3] = vmlal_high_s8(part[r][3], high, x);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) {
          isum[r][2 * j] = vaddw_s16(isum[r][2 * j], vget_low_s16(part[r][j]));
          isum[r][2 * j + 1] = vaddw_high_s16(isum[r][2 * j + 1], part[r][j]);
        }
    }
    const int64_t g = g0 / group;
    for (int i = 0; i < 8; ++i) {  // this block's (scale, offset) bf16 pairs of output rows 4i..4i+3 for the group
      const uint32x4_t packed = vld1q_u32(group_pairs(pairs, g) + 4 * i);
      const float32x4_t scale = vreinterpretq_f32_u32(vshlq_n_u32(packed, 16));
      const float32x4_t offset = vreinterpretq_f32_u32(vandq_u32(packed, vdupq_n_u32(0xFFFF0000u)));
      for (int r = 0; r < R; ++r) {
        const int32_t code_sum = code_sums[r * groups + g];
        const float32x4_t centred =  // exact: |isum - 8 * code_sum| < 2^24
            vcvtq_f32_s32(vsubq_s32(isum[r][i], vdupq_n_s32(8 * code_sum)));
        const float32x4_t term = vfmaq_f32(vmulq_f32(offset, vdupq_n_f32(code_sum)), scale, centred);
        acc[r][i] = vfmaq_f32(acc[r][i], term, vdupq_n_f32(x_scales[r * groups + g]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 8; ++i) vst1q_f32(y + r * N + 4 * i, acc[r][i]);
}

#else
#error "simd_int.h needs AVX2 or aarch64's NEON"
#endif

}  // namespace pagoda::int_kernels
