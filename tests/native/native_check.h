// What the torch-free kernel tests (simd_kernels_test.cpp, int_kernels_test.cpp) share: bf16 conversions written
// out in scalar code, seeded random inputs, and a tolerance check that reports each result and counts failures.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace native_check {

using pagoda::simd::bf16;

inline int checks = 0, failures = 0;

// Rounds to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion, written out in scalar code.
inline bf16 to_bf16(float value) {
  if (std::isnan(value)) return {0x7FC0};
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return {static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)};
}
inline float to_float(bf16 value) {
  const uint32_t bits = uint32_t{value.bits} << 16;
  float result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}
inline float to_float(float value) { return value; }
template <typename T> T from_float(float value);
template <> inline float from_float<float>(float value) { return value; }
template <> inline bf16 from_float<bf16>(float value) { return to_bf16(value); }
// value as T would hold it.
template <typename T> float rounded(float value) { return to_float(from_float<T>(value)); }
template <typename T> const char* type_name() { return std::is_same_v<T, float> ? "fp32" : "bf16"; }

template <typename T>
std::vector<T> random_values(std::mt19937& rng, size_t count, float low = -1.0f, float high = 1.0f) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<T> values(count);
  for (auto& value : values) value = from_float<T>(uniform(rng));
  return values;
}

// Passes where every |got - want| <= abs_tol + rel_tol * |want| (scale: a per-element magnitude for want).
template <typename G>
void check(const std::string& name, const std::vector<G>& got, const std::vector<double>& want, double abs_tol,
           double rel_tol, const std::vector<double>* scale = nullptr) {
  ++checks;
  double worst = 0;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::fabs(double(to_float(got[i])) - want[i]);
    const double magnitude = scale ? (*scale)[i] : std::fabs(want[i]);
    worst = std::max(worst, error);
    if (!(error <= abs_tol + rel_tol * magnitude)) ++bad;
  }
  if (bad != 0) ++failures;
  std::printf("%s %s: max |error| %.3g (%zu of %zu elements out of tolerance)\n", bad ? "FAIL" : "ok", name.c_str(),
              worst, bad, want.size());
}

inline const char* architecture() {
#if defined(__aarch64__)
  return "aarch64";
#else
  return "x86_64";
#endif
}

// Records one exact check: passes iff `bad` is 0.
inline void check_exact(const std::string& name, size_t bad, size_t total) {
  ++checks;
  if (bad) ++failures;
  std::printf("%s %s: %zu of %zu differ (exact)\n", bad ? "FAIL" : "ok", name.c_str(), bad, total);
}

}  // namespace native_check
