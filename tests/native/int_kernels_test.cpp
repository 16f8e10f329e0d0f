// Torch-free tests of the integer matmuls' cores (simd_int.h: x quantized per group, int8 and int4 weight rows
// against its codes) against scalar references, for whichever form the compiler builds (AVX2, or aarch64's NEON
// under qemu-aarch64): tests/test_native_kernels.py compiles and runs it once per target. Inputs are seeded.
// Integer results (codes, sums) are checked exactly; fp32 results within their summation-order bound, and each
// row of a batch exactly against the row alone. Exits non-zero if any check fails.
#include "native_check.h"
#include "simd_int.h"

namespace {

using namespace native_check;
namespace ik = pagoda::int_kernels;

std::string shape(const char* what, int64_t rows, int64_t K, int64_t group) {
  return std::string(what) + " rows=" + std::to_string(rows) + " K=" + std::to_string(K) +
         " group=" + std::to_string(group);
}

struct Quantized {
  std::vector<int8_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

// The scalar rule: scale max|x| / 127, codes x / scale rounded half to even and clamped, 0 for a group of zeros.
Quantized reference_quantize(const std::vector<float>& x, int64_t rows, int64_t K, int64_t group) {
  Quantized q{std::vector<int8_t>(rows * K), std::vector<float>(rows * K / group), std::vector<int32_t>(rows * K / group)};
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < K / group; ++g) {
      float largest = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) largest = std::max(largest, std::fabs(x[m * K + k]));
      const float scale = largest / 127.0f;
      int32_t sum = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {
        const float code = scale > 0.0f ? std::nearbyint(x[m * K + k] / scale) : 0.0f;
        q.codes[m * K + k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
        sum += q.codes[m * K + k];
      }
      q.scales[m * K / group + g] = scale;
      q.sums[m * K / group + g] = sum;
    }
  return q;
}

Quantized quantize(const std::vector<float>& x, int64_t rows, int64_t K, int64_t group) {
  Quantized q{std::vector<int8_t>(rows * K), std::vector<float>(rows * K / group), std::vector<int32_t>(rows * K / group)};
  for (int64_t m = 0; m < rows; ++m)
    ik::quantize_row(x.data() + m * K, K, group, q.codes.data() + m * K, q.scales.data() + m * K / group,
                     q.sums.data() + m * K / group);
  return q;
}

// Inputs of several magnitudes, with one group of zeros and values on rounding ties.
std::vector<float> activations(std::mt19937& rng, int64_t rows, int64_t K, int64_t group) {
  std::vector<float> x = random_values<float>(rng, rows * K, -3.0f, 3.0f);
  for (int64_t m = 0; m < rows; ++m) x[m * K] *= 40.0f;
  if (K / group > 1)
    for (int64_t k = group; k < 2 * group; ++k) x[k] = 0.0f;
  return x;
}

void check_quantize(std::mt19937& rng, int64_t rows, int64_t K, int64_t group) {
  const std::vector<float> x = activations(rng, rows, K, group);
  const Quantized got = quantize(x, rows, K, group), want = reference_quantize(x, rows, K, group);
  size_t bad = 0;
  for (size_t i = 0; i < got.codes.size(); ++i) bad += got.codes[i] != want.codes[i];
  for (size_t i = 0; i < got.scales.size(); ++i)
    bad += std::memcmp(&got.scales[i], &want.scales[i], sizeof(float)) != 0 || got.sums[i] != want.sums[i];
  check_exact(shape("quantize", rows, K, group), bad, got.codes.size() + got.scales.size());
}

// out[r * N + n] for every row of the batch, R rows at a time, and each row alone: the batch must equal the rows.
template <typename Rows>
void run_batched(int64_t rows, Rows run) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) run(std::integral_constant<int, 4>{}, m);
  for (; m + 2 <= rows; m += 2) run(std::integral_constant<int, 2>{}, m);
  for (; m < rows; ++m) run(std::integral_constant<int, 1>{}, m);
}

size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  size_t count = 0;
  for (size_t i = 0; i < a.size(); ++i) count += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return count;
}

void check_int8(std::mt19937& rng, int64_t rows, int64_t K, int64_t N) {
  const int64_t group = ik::kInt8Group, groups = K / group;
  const Quantized x = quantize(activations(rng, rows, K, group), rows, K, group);
  std::uniform_int_distribution<int> code(-127, 127);
  std::vector<int8_t> w(N * K);
  for (auto& value : w) value = static_cast<int8_t>(code(rng));
  std::vector<float> y(rows * N), alone(rows * N);
  std::vector<double> want(rows * N), magnitude(rows * N);
  for (int64_t n = 0; n < N; ++n) {
    run_batched(rows, [&](auto count, int64_t m) {
      ik::int8_row_dots<decltype(count)::value>(w.data() + n * K, x.codes.data() + m * K, x.scales.data() + m * groups,
                                                K, N, y.data() + m * N + n);
    });
    for (int64_t m = 0; m < rows; ++m) {
      ik::int8_row_dots<1>(w.data() + n * K, x.codes.data() + m * K, x.scales.data() + m * groups, K, N,
                           alone.data() + m * N + n);
      for (int64_t k = 0; k < K; ++k) {
        const double term = double(x.scales[m * groups + k / group]) * x.codes[m * K + k] * w[n * K + k];
        want[m * N + n] += term;
        magnitude[m * N + n] += std::fabs(term);
      }
    }
  }
  const std::string name = shape("int8 dots", rows, K, group) + " N=" + std::to_string(N);
  check(name, y, want, 0, double(K) * 0x1p-24, &magnitude);
  check_exact(name + " each row as alone", differing(y, alone), y.size());
}

// bf16 bits of a value drawn in [low, high).
uint16_t bf16_bits(std::mt19937& rng, float low, float high) {
  return to_bf16(std::uniform_real_distribution<float>(low, high)(rng)).bits;
}

void check_int4(std::mt19937& rng, int64_t rows, int64_t K, int64_t group) {
  const int64_t N = 2 * ik::kBlockRows, groups = K / group;
  const Quantized x = quantize(activations(rng, rows, K, group), rows, K, group);
  std::uniform_int_distribution<int> nibble(0, 15);
  std::vector<uint8_t> q(N * K), packed(N * K / 2);
  for (auto& value : q) value = static_cast<uint8_t>(nibble(rng));
  std::vector<uint32_t> pairs(N * groups);  // block-major: [N / 32][groups][32], scale's bits low, offset's high
  for (auto& pair : pairs) pair = bf16_bits(rng, 0.01f, 0.1f) | uint32_t{bf16_bits(rng, -0.2f, 0.2f)} << 16;
  for (int64_t n = 0; n < N; ++n)  // a block's column k: 16 bytes, byte i = row i (low nibble) | row i + 16 (high)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = n / ik::kBlockRows, i = n % ik::kBlockRows;
      uint8_t& byte = packed[b * ik::kBlockRows * K / 2 + k * 16 + i % 16];
      byte |= i < 16 ? q[n * K + k] : q[n * K + k] << 4;
    }
  std::vector<float> y(rows * N), alone(rows * N);
  std::vector<double> want(rows * N), magnitude(rows * N);
  for (int64_t b = 0; b < N / ik::kBlockRows; ++b) {
    const uint8_t* block = packed.data() + b * ik::kBlockRows * K / 2;
    const uint32_t* block_pairs = ik::block_pairs(pairs.data(), b, groups);
    auto rows_of = [&](auto count, int64_t m, float* out) {
      ik::int4_block_rows<decltype(count)::value>(block, x.codes.data() + m * K, x.scales.data() + m * groups,
                                                  x.sums.data() + m * groups, block_pairs, N, K, group,
                                                  out + m * N + b * ik::kBlockRows);
    };
    run_batched(rows, [&](auto count, int64_t m) { rows_of(count, m, y.data()); });
    for (int64_t m = 0; m < rows; ++m) rows_of(std::integral_constant<int, 1>{}, m, alone.data());
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t pair = ik::group_pairs(ik::block_pairs(pairs.data(), n / 32, groups), k / group)[n % 32];
        const double scale = to_float(bf16{uint16_t(pair & 0xFFFF)}), offset = to_float(bf16{uint16_t(pair >> 16)});
        const double weight = (double(q[n * K + k]) - 8) * scale + offset;
        const double term = weight * x.codes[m * K + k] * x.scales[m * groups + k / group];
        want[m * N + n] += term;
        magnitude[m * N + n] += std::fabs(term);
      }
  const std::string name = shape("int4 block rows", rows, K, group);
  check(name, y, want, 0, double(K) * 0x1p-24, &magnitude);
  check_exact(name + " each row as alone", differing(y, alone), y.size());
}

}  // namespace

int main() {
  std::printf("target: %s\n", architecture());
  std::mt19937 rng(20261207);
  for (int64_t group : {32, 64, 128}) check_quantize(rng, 3, 256, group);
  for (int64_t rows : {1, 2, 3, 4, 7})
    for (int64_t K : {32, 256}) check_int8(rng, rows, K, 19);
  for (int64_t rows : {1, 2, 3, 4, 7})
    for (int64_t group : {32, 64}) check_int4(rng, rows, 256, group);
  check_int4(rng, 5, 512, 128);
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
