// int4 weights against any number of rows of x, decode and prefill alike: y[m, n] = sum_k x[m, k] * W[n, k], W held
// in pagoda's int4 layout (simd_int.h) with a bf16 (scale, offset) per group of input columns, x quantized per
// group to int8 (as llama.cpp does for its 4-bit formats) so that the inner loop is integer.
//
// Two forms of the same sums, chosen at compile time: simd_int.h's int4_block_rows (AVX2 or NEON: the AVX2,
// AVX-512F and aarch64 modules) and, here, AVX-512 (the full set), which halves the instructions per weight. Integer products
// also keep prefill ahead of dequantizing W into fp32 GEMMs (1.7-2.6x at 64-256 rows on bench-1b's shapes, AVX2
// Zen 3): 32 multiply-adds an instruction against an fp32 FMA's 8.
#include <torch/extension.h>
#include <ATen/Parallel.h>

// The AVX-512 form needs the full set's VBMI (vpermb) and VNNI (vpdpbusd); the AVX-512F module runs simd_int.h's.
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define PAGODA_INT4_FULL_SET 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_ops.h"
#include "cpu_x_codes.h"

namespace {

using pagoda::int_kernels::block_pairs;
using pagoda::int_kernels::group_pairs;
using pagoda::int_kernels::kBlockRows;
using pagoda::int_kernels::kPrefetchBytes;
using pagoda::int_kernels::kPrefetchGroups;
using pagoda::int_kernels::prefetch_pairs;

#ifndef PAGODA_INT4_FULL_SET
template <int R, int S>  // S: blocks at once, 1 here
void block_rows(const uint8_t* block, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                const uint32_t* pairs, int64_t N, int64_t K, int64_t group, float* y) {
  static_assert(S == 1, "the AVX2 and NEON forms take one block at a time");
  pagoda::int_kernels::int4_block_rows<R>(block, codes, x_scales, code_sums, pairs, N, K, group, y);
}
template <int R>
constexpr int kStreams = 1;
// Beyond this many rows, dequantized tiles into oneDNN's GEMM beat this form (AVX2 Zen 3, bench models' shapes:
// the kernel 2-3x faster at 1-64 rows, 1.6-2.2x at 128, 0.9-1.5x at 512, 0.8-1.1x at 2048). The NEON form takes
// the same bound, not measured on ARM hardware.
constexpr int64_t kMaxRows = 512;
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
        pagoda::int_kernels::prefetch_line_into_l2(column + kPrefetchBytes);
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

// Many rows (prefill, batched verification) take the columns the other way round: 32 columns of a block are
// unpacked once into registers (16 of them), and every row of a pass takes them, R rows at a time, x's codes
// broadcast from memory. Unpacking, most of the per-weight work above, is then paid once per pass instead of once
// per R rows. Per chunk and row, the pass's strip of y gains scale * x_scale * isum; at a group's end,
// base * x_scale * code_sum, base = offset - 8 * scale (the same W * x as the form above, summed in another order).
constexpr int64_t kChunkColumns = 32;
// From this many rows of x on, a matmul takes the unpack-once form (bench-1b's shapes, 2 threads: 0.8-0.9x the
// other form's time at 8 rows, 0.8x at 16, 0.55-0.6x from 32 on).
constexpr int64_t kUnpackOnceRows = 8;
// Rows of x a block's unpacked chunk serves before the next is unpacked: their strip of y (16 KB) stays in L1.
constexpr int64_t kStripRows = 128;
// The unpack-once form beats dequantized tiles into oneDNN's GEMM at every size measured (4-6x at 512-2048 rows,
// bench-1b's shapes, AVX-512 Xeon): no bound.
constexpr int64_t kMaxRows = std::numeric_limits<int64_t>::max();

// x's codes chunk-major, [K / 32][M][32], and its per-group arrays group-major, [groups][M]: a chunk's rows are
// adjacent. (Row-major rows are K bytes apart, a power of two or near it, so a pass's rows of one chunk share a
// few L1 sets and evict each other.)
struct ChunkMajorCodes {
  torch::Tensor codes, scales, sums;
  int64_t rows;
  const int8_t* code_data;  // the tensors' data, read once (as XCodes does)
  const float* scale_data;
  const int32_t* sum_data;

  explicit ChunkMajorCodes(const pagoda::XCodes& xq) : rows(xq.codes.size(0)) {
    const int64_t K = xq.codes.size(1);
    codes = xq.codes.view({rows, K / kChunkColumns, kChunkColumns}).transpose(0, 1).contiguous();
    scales = xq.scales.t().contiguous();
    sums = xq.sums.t().contiguous();
    code_data = codes.data_ptr<int8_t>();
    scale_data = scales.data_ptr<float>();
    sum_data = sums.data_ptr<int32_t>();
  }
  const int8_t* chunk(int64_t k, int64_t m) const { return code_data + (k / kChunkColumns * rows + m) * kChunkColumns; }
  const float* group_scales(int64_t g, int64_t m) const { return scale_data + g * rows + m; }
  const int32_t* group_sums(int64_t g, int64_t m) const { return sum_data + g * rows + m; }
};

using Unpacked = __m512i[kChunkColumns / 2];  // columns 4j..4j+3 of rows 0-15 at [2j], of rows 16-31 at [2j + 1]

inline void unpack_chunk(const uint8_t* columns, Unpacked& w) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i rows_by_column = _mm512_load_si512(kRowsByColumn.bytes);
  for (int j = 0; j < kChunkColumns / 4; ++j) {
    const __m512i four = _mm512_loadu_si512(columns + 64 * j);
    w[2 * j] = _mm512_permutexvar_epi8(rows_by_column, _mm512_and_si512(four, nibble));
    w[2 * j + 1] = _mm512_permutexvar_epi8(rows_by_column, _mm512_and_si512(_mm512_srli_epi16(four, 4), nibble));
  }
}

// R rows of x (their codes for the chunk at codes[32 r], their group's scales and code sums at [r]) against an
// unpacked chunk: strip[r] += scale * x_scale[r] * isum (and at a group's end, base * x_scale[r] * code_sum[r]).
template <int R>
inline void rows_into_strip(const Unpacked& w, const int8_t* codes, const float* x_scales, const int32_t* code_sums,
                            const __m512 (&scale)[2], const __m512 (&base)[2], bool group_ends, __m512 (*strip)[2]) {
  __m512i isum[R][2];
  for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
  for (int j = 0; j < kChunkColumns / 4; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, codes + r * kChunkColumns + 4 * j, sizeof(quad));
      const __m512i x = _mm512_set1_epi32(quad);
      isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w[2 * j], x);
      isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w[2 * j + 1], x);
    }
  for (int r = 0; r < R; ++r) {
    const __m512 x_scale = _mm512_set1_ps(x_scales[r]);
    for (int h = 0; h < 2; ++h) {
      __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][h]), _mm512_mul_ps(scale[h], x_scale), strip[r][h]);
      if (group_ends) sum = _mm512_fmadd_ps(base[h], _mm512_set1_ps(x_scales[r] * code_sums[r]), sum);
      strip[r][h] = sum;
    }
  }
}

// Rows m0..m1 (at most a pass) of x against one block (its weights at `block`, its pairs at `pairs`): y's 32 columns
// of the block, which `y` points at (row 0).
void block_many_rows(const uint8_t* block, const ChunkMajorCodes& xq, int64_t m0, int64_t m1, const uint32_t* pairs,
                     int64_t N, int64_t K, int64_t group, float* y) {
  const int64_t groups = K / group;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 strip[kStripRows][2];  // y's rows m0..m1 for the block, contiguous
  for (int64_t m = 0; m < m1 - m0; ++m) strip[m][0] = strip[m][1] = _mm512_setzero_ps();
  Unpacked w;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[2], base[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i packed = _mm512_loadu_si512(group_pairs(pairs, g) + 16 * h);
      scale[h] = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
      base[h] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale[h],
                                 _mm512_castsi512_ps(_mm512_and_si512(packed, high_half)));
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += kChunkColumns) {
      unpack_chunk(block + k * 16, w);
      const bool group_ends = k + kChunkColumns == (g + 1) * group;
      pagoda::for_row_groups(m0, m1, [&](auto count, int64_t m) {
        rows_into_strip<decltype(count)::value>(w, xq.chunk(k, m), xq.group_scales(g, m), xq.group_sums(g, m), scale,
                                                base, group_ends, strip + (m - m0));
      });
    }
  }
  for (int64_t m = m0; m < m1; ++m)
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(y + m * N + 16 * h, strip[m - m0][h]);
}
#endif

}  // namespace

int64_t matmul_int4_max_rows() { return kMaxRows; }

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
#ifdef PAGODA_INT4_FULL_SET
  if (M >= kUnpackOnceRows) {
    const ChunkMajorCodes chunked(xq);
    // A block's weights (K * 16 bytes) stay in L2 while the passes over rows take them.
    at::parallel_for(0, N / kBlockRows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m0 = 0; m0 < M; m0 += kStripRows)
          block_many_rows(wp + b * kBlockRows * K / 2, chunked, m0, std::min(M, m0 + kStripRows),
                          block_pairs(so, b, K / group), N, K, group, yp + b * kBlockRows);
    });
    return y.to(x.scalar_type());
  }
#endif
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
