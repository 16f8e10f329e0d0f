// int4 weights against any number of rows of x, decode and prefill alike: y[m, n] = sum_k x[m, k] * W[n, k], W held
// in pagoda's int4 layout (model/int4.py's pack_int4) with a bf16 (scale, offset) per group of input columns
// (`pack_group_pairs`): W = (q - 8) * scale + offset, q in 0..15.
//
// Two forms of the same sums, chosen at compile time: AVX2 (the AVX2 module, for CPUs without AVX-512) and
// AVX-512 (the full set), which halves the instructions per weight. As llama.cpp
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
// nibbles are rearranged into (column k, column k + 1) pairs per row, the order vpmaddubsw sums. The (scale,
// offset) pairs are block-major too, [N / 32, K / group, 32, 2]: a block's pairs for one group (128 bytes) are
// followed by its next group's, so a block's scales are a second sequential stream beside its weights. (In torch's
// [K / group, N, 2] a block's next pairs are a row of the array away; that stride defeats the prefetchers and
// held batch-1 decode to 0.3-0.6 of the read bandwidth at group 32, against 0.7-0.9 block-major.)
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
// The pairs of the group this many ahead are prefetched: a block's pairs are only 1/4 of its bytes at group 32, a
// stream too thin for the hardware prefetchers to run ahead of.
constexpr int64_t kPrefetchGroups = 4;
constexpr int64_t kPairBytes = kBlockRows * 4;  // a block's (scale, offset) pairs for one group

// One thread streams one block at a time, a single sequential stream, which the hardware prefetchers alone keep
// well below a core's share of memory bandwidth; software prefetches into L2 this far ahead (into the next block at a
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
  for (int64_t line = 0; line < kPairBytes; line += 64) _mm_prefetch(pairs + line, _MM_HINT_T0);
}

// S blocks of 32 output rows (one block of the layout is K * 16 bytes; S adjacent ones start at `block`, their pairs
// at `pairs`) against R quantized rows of x (codes[r * K], the per-group arrays at [r * groups]): y[r * N + n] =
// sum_g x_scale[g] * (scale[g, n] * (isum[g, n] - 8 * code_sum[g]) + offset[g, n] * code_sum[g]), isum[g, n] = sum
// over the group of q[n, k] * code[k]. The nibbles of each pair of columns are rearranged once for all R rows (the
// rearranging is most of the work).
#ifndef __AVX512BW__
template <int R, int S>  // S: blocks at once, 1 here
void block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y) {
  static_assert(S == 1, "the AVX2 form takes one block at a time");
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
        if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(block + k * 16 + kPrefetchBytes), _MM_HINT_T0);
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
template <int R>
constexpr int kStreams = 1;
#else
// The same sums on AVX-512 with VNNI and VBMI (compiled into the full set). One 64-byte load is four columns of a
// block; one vpermb per nibble half turns its (column, row) bytes into (row, column), a dword per row holding
// columns k..k+3, and vpdpbusd adds those four products to the row's int32 sum against the broadcast codes
// x[k..k+3]: 5 instructions unpack 128 weights, 2 a row of x take them (the AVX2 form's 16-bit pairs need 14),
// which on a core that streams memory faster than the AVX2 form computes is the difference between compute and
// memory bound. int32 sums do not overflow: a group of 256 columns sums at most 256 * 15 * 127 < 2^20.
// vpermb's indices: byte 4 * row + c of the result is byte 16 * c + row of a load (row 0..15, column c 0..3).
struct alignas(64) RowsByColumn {
  int8_t bytes[64];
  constexpr RowsByColumn() : bytes() {
    for (int row = 0; row < 16; ++row)
      for (int c = 0; c < 4; ++c) bytes[4 * row + c] = static_cast<int8_t>(16 * c + row);
  }
};
constexpr RowsByColumn kRowsByColumn;

template <int R, int S>
void block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y) {
  const int64_t groups = K / group, block_bytes = kBlockRows * K / 2;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i rows_by_column = _mm512_load_si512(kRowsByColumn.bytes);
  __m512 acc[S][R][2];  // acc[s][r][h]: row r of x against output rows 16h..16h+15 of block s, in fp32
  for (int b = 0; b < S; ++b)
    for (int r = 0; r < R; ++r) acc[b][r][0] = acc[b][r][1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const int64_t g = g0 / group;
    for (int b = 0; b < S; ++b) prefetch_pairs(block_pairs(pairs, b, groups), g + kPrefetchGroups, groups);
    __m512i isum[S][R][2];
    for (int b = 0; b < S; ++b)
      for (int r = 0; r < R; ++r) isum[b][r][0] = isum[b][r][1] = _mm512_setzero_si512();
    for (int64_t k = g0; k < g0 + group; k += 4) {
      __m512i x[R];
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, codes + r * K + k, sizeof(quad));
        x[r] = _mm512_set1_epi32(quad);
      }
      for (int b = 0; b < S; ++b) {
        const uint8_t* column = block + b * block_bytes + k * 16;
        _mm_prefetch(reinterpret_cast<const char*>(column + kPrefetchBytes), _MM_HINT_T1);  // into L2
        const __m512i four = _mm512_loadu_si512(column);
        const __m512i low = _mm512_permutexvar_epi8(rows_by_column, _mm512_and_si512(four, nibble));
        const __m512i high =
            _mm512_permutexvar_epi8(rows_by_column, _mm512_and_si512(_mm512_srli_epi16(four, 4), nibble));
        for (int r = 0; r < R; ++r) {
          isum[b][r][0] = _mm512_dpbusd_epi32(isum[b][r][0], low, x[r]);
          isum[b][r][1] = _mm512_dpbusd_epi32(isum[b][r][1], high, x[r]);
        }
      }
    }
    for (int b = 0; b < S; ++b)
      for (int h = 0; h < 2; ++h) {
        // this block's (scale, offset) bf16 pairs for output rows 16h..16h+15
        const __m512i packed = _mm512_loadu_si512(group_pairs(block_pairs(pairs, b, groups), g) + 16 * h);
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
        const __m512 offset = _mm512_castsi512_ps(_mm512_and_si512(packed, high_half));
        for (int r = 0; r < R; ++r) {
          const int32_t code_sum = code_sums[r * groups + g];
          const __m512 centred =  // exact: |isum - 8 * code_sum| < 2^24
              _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[b][r][h], _mm512_set1_epi32(8 * code_sum)));
          const __m512 term = _mm512_fmadd_ps(scale, centred, _mm512_mul_ps(offset, _mm512_set1_ps(code_sum)));
          acc[b][r][h] = _mm512_fmadd_ps(term, _mm512_set1_ps(x_scales[r * groups + g]), acc[b][r][h]);
        }
      }
  }
  for (int b = 0; b < S; ++b)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(y + r * N + b * kBlockRows + 16 * h, acc[b][r][h]);
}
// One row of x keeps four blocks streaming at once (eight streams with their pairs): a single sequential stream a
// core leaves memory idle between its requests (bench-1b's shapes at batch 1: 2 blocks 1.3x 1, 4 blocks 1.05-1.15x
// 2); more rows are compute enough.
template <int R>
constexpr int kStreams = R == 1 ? 4 : 1;
#endif

}  // namespace

torch::Tensor matmul_int4(const torch::Tensor& x, const torch::Tensor& packed, int64_t group,
                        const torch::Tensor& scales_and_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M >= 1, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be contiguous uint8 [N, K / 2] in pagoda's int4 layout");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "x and packed disagree on K");
  TORCH_CHECK(N % kBlockRows == 0, "N must be a multiple of 32");
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "the group must be a multiple of 32 dividing K");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 4 && scales_and_zeros.size(0) == N / kBlockRows &&
                  scales_and_zeros.size(1) == K / group && scales_and_zeros.size(2) == kBlockRows &&
                  scales_and_zeros.size(3) == 2,
              "scales_and_zeros must be contiguous bf16 [N / 32, K / group, 32, 2]");
  const pagoda::XCodes xq(x, group);
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* so = reinterpret_cast<const uint32_t*>(scales_and_zeros.data_ptr<at::BFloat16>());
  // Within a pass, each block's weights (K * 16 bytes; a pair of blocks where one row streams two at once) stay in
  // L1/L2 while every row passes over them.
  for (int64_t m0 = 0; m0 < M; m0 += pagoda::kRowsPerPass) {
    at::parallel_for(0, N / kBlockRows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b0 = begin; b0 < end; b0 += kStreams<1>) {
        const int64_t blocks = std::min<int64_t>(kStreams<1>, end - b0);
        pagoda::for_row_groups(m0, std::min(M, m0 + pagoda::kRowsPerPass), [&](auto count, int64_t m) {
          constexpr int R = decltype(count)::value;
          auto run = [&](auto streams, int64_t b) {
            block_rows<R, decltype(streams)::value>(wp + b * kBlockRows * K / 2, xq.row_codes(m), xq.row_scales(m),
                                                    xq.row_sums(m), block_pairs(so, b, K / group), N, K, group,
                                                    yp + m * N + b * kBlockRows);
          };
          if (blocks == kStreams<R>) return run(std::integral_constant<int, kStreams<R>>{}, b0);
          for (int64_t b = b0; b < b0 + blocks; ++b) run(std::integral_constant<int, 1>{}, b);
        });
      }
    });
  }
  return y.to(x.scalar_type());
}
