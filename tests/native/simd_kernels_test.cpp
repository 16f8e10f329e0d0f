// Torch-free tests of the simd_*.h kernel cores against scalar references, for whichever target the compiler
// builds cpu_simd.h for (AVX-512, AVX2, or aarch64's NEON under qemu-aarch64): tests/test_native_kernels.py
// compiles and runs it once per target. Inputs are seeded; each check states its tolerance. Exits non-zero
// if any check fails.
#include "native_check.h"
#include "simd_attention.h"
#include "simd_fused.h"
#include "simd_gemv.h"

namespace {

using namespace native_check;
using pagoda::kv_quant::fp8_e4m3;
using pagoda::kv_quant::KVCacheView;
using pagoda::kv_quant::KVFormat;
namespace kernels = pagoda::simd_kernels;

void check_bf16_rounding() {
  const std::vector<uint32_t> patterns = {0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F817FFF, 0x7F7FFFFF,
                                          0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x00000001, 0x80000000,
                                          0x7F808000, 0xC0490FDB, 0x33800000, 0x4B7FFF80};
  std::vector<float> values(patterns.size());
  std::memcpy(values.data(), patterns.data(), patterns.size() * sizeof(float));
  std::vector<bf16> got(values.size());
  for (size_t i = 0; i < values.size(); i += pagoda::simd::kLanes)
    pagoda::simd::store_at(got.data(), int64_t(i), int64_t(values.size()), pagoda::simd::load_at(values.data(), int64_t(i), int64_t(values.size())));
  size_t bad = 0;
  for (size_t i = 0; i < values.size(); ++i) bad += got[i].bits != to_bf16(values[i]).bits;
  check_exact("bf16 rounding of edge patterns", bad, values.size());
}

template <typename W>
void check_gemv(std::mt19937& rng, int64_t M, int64_t K, int64_t N) {
  std::vector<float> x = random_values<float>(rng, M * K);
  if constexpr (!std::is_same_v<W, float>)
    for (auto& value : x) value = rounded<bf16>(value);  // the kernel's contract: x rounded to bf16 first
  const std::vector<W> w = random_values<W>(rng, N * K);
  std::vector<float> laid_out = x;
  if constexpr (!std::is_same_v<W, float>) kernels::lay_out_pairs(x.data(), laid_out.data(), M, K);
  std::vector<float> y(M * N);
  const int64_t split = N / 2 + 1;  // two channel ranges, as two threads would take them
  kernels::gemv_channels(laid_out.data(), w.data(), y.data(), M, K, N, 0, split);
  kernels::gemv_channels(laid_out.data(), w.data(), y.data(), M, K, N, split, N);
  std::vector<double> want(M * N), magnitude(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0, absolute = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double product = double(x[m * K + k]) * to_float(w[n * K + k]);
        sum += product;
        absolute += std::fabs(product);
      }
      want[m * N + n] = sum;
      magnitude[m * N + n] = absolute;
    }
  // fp32 accumulation over K terms in a different order: K * 2^-24 of the sum of |products| bounds it.
  const std::string name = "gemv " + std::string(type_name<W>()) + " M=" + std::to_string(M) +
                           " K=" + std::to_string(K) + " N=" + std::to_string(N);
  check(name, y, want, 0, double(K) * 0x1p-24, &magnitude);
  // Batch invariance: each row alone gives the same bits as in the batch (decode batches change every step).
  size_t differ = 0;
  std::vector<float> alone(N);
  for (int64_t m = 0; m < M; ++m) {
    kernels::gemv_channels(laid_out.data() + m * K, w.data(), alone.data(), 1, K, N, 0, N);
    for (int64_t n = 0; n < N; ++n) differ += std::memcmp(&alone[n], &y[m * N + n], sizeof(float)) != 0;
  }
  ++checks;
  if (differ) ++failures;
  std::printf("%s %s: %zu outputs differ from the row alone (exact)\n", differ ? "FAIL" : "ok", name.c_str(), differ);
}

template <typename T>
void check_add_rms_norm(std::mt19937& rng, int64_t rows, int64_t n, bool with_delta) {
  std::vector<T> x = random_values<T>(rng, rows * n), delta = random_values<T>(rng, rows * n);
  const std::vector<T> weight = random_values<T>(rng, n, 0.5f, 1.5f), x_before = x;
  std::vector<T> out(rows * n);
  const float eps = 1e-6f;
  const T* delta_data = with_delta ? delta.data() : nullptr;
  kernels::add_rms_norm_rows(x.data(), delta_data, weight.data(), out.data(), n, eps, 0, 1);
  kernels::add_rms_norm_rows(x.data(), delta_data, weight.data(), out.data(), n, eps, 1, rows);
  std::vector<double> want_x(rows * n), want_out(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double squares = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = to_float(x_before[r * n + i]);
      want_x[r * n + i] = with_delta ? rounded<T>(v + to_float(delta[r * n + i])) : v;
      squares += want_x[r * n + i] * want_x[r * n + i];
    }
    const double inv_rms = 1.0 / std::sqrt(squares / n + eps);
    for (int64_t i = 0; i < n; ++i)
      want_out[r * n + i] = to_float(weight[i]) * rounded<T>(float(want_x[r * n + i] * inv_rms));
  }
  const std::string name = std::string("add_rms_norm ") + type_name<T>() + " n=" + std::to_string(n) +
                           (with_delta ? " with delta" : "");
  check(name + ": x", x, want_x, 0, 0);  // one add, one rounding: exact
  // fp32: a reordered sum of squares; bf16: that can move the normed value across one rounding, plus the store's.
  check(name + ": out", out, want_out, 1e-6, std::is_same_v<T, float> ? 1e-5 : 0x1p-6);
}

template <typename T>
void check_rotary(std::mt19937& rng, int64_t tokens, int64_t H, int64_t KVH, int64_t D) {
  const int64_t row = (H + 2 * KVH) * D, num_slots = tokens + 3;
  std::vector<T> qkv = random_values<T>(rng, tokens * row), cos = random_values<T>(rng, tokens * D),
                 sin = random_values<T>(rng, tokens * D);
  const std::vector<T> before = qkv;
  std::vector<T> k_cache(num_slots * KVH * D, from_float<T>(7.0f)), v_cache = k_cache;
  std::vector<int64_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = (t * 5 + 2) % num_slots;
  KVCacheView cache;
  cache.k = k_cache.data();
  cache.v = v_cache.data();
  kernels::rotary_write_kv_rows(qkv.data(), cos.data(), sin.data(), cache, slots.data(), H, KVH, D, 0, tokens);
  std::vector<double> want(tokens * row), want_k(k_cache.size(), 7.0), want_v(v_cache.size(), 7.0);
  const int64_t half = D / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < row; ++e) want[t * row + e] = to_float(before[t * row + e]);
    for (int64_t h = 0; h < H + KVH; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const int64_t base = t * row + h * D;
        const float x1 = to_float(before[base + i]), x2 = to_float(before[base + half + i]);
        const float c1 = to_float(cos[t * D + i]), c2 = to_float(cos[t * D + half + i]);
        const float s1 = to_float(sin[t * D + i]), s2 = to_float(sin[t * D + half + i]);
        want[base + i] = rounded<T>(rounded<T>(x1 * c1) - rounded<T>(x2 * s1));
        want[base + half + i] = rounded<T>(rounded<T>(x2 * c2) + rounded<T>(x1 * s2));
      }
    for (int64_t e = 0; e < KVH * D; ++e) {
      want_k[slots[t] * KVH * D + e] = want[t * row + H * D + e];
      want_v[slots[t] * KVH * D + e] = want[t * row + (H + KVH) * D + e];
    }
  }
  const std::string name = std::string("rotary_write_kv ") + type_name<T>() + " D=" + std::to_string(D);
  check(name + ": qkv", qkv, want, 0, 0);  // elementwise, each op rounded as the reference rounds it: exact
  check(name + ": k cache", k_cache, want_k, 0, 0);
  check(name + ": v cache", v_cache, want_v, 0, 0);
}

template <typename T>
void check_silu_mul(std::mt19937& rng, int64_t rows, int64_t I) {
  const std::vector<T> gate_up = random_values<T>(rng, rows * 2 * I, -12.0f, 12.0f);
  std::vector<T> out(rows * I);
  kernels::silu_mul_rows(gate_up.data(), out.data(), I, 0, rows);
  std::vector<double> want(rows * I);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const double g = to_float(gate_up[r * 2 * I + i]), up = to_float(gate_up[r * 2 * I + I + i]);
      want[r * I + i] = rounded<T>(float(g / (1 + std::exp(-g)))) * up;
    }
  // fp32: exp's polynomial (~2e-7) and a division; bf16: that can move silu across one rounding, plus the store's.
  check(std::string("silu_mul ") + type_name<T>() + " I=" + std::to_string(I), out, want, 1e-7,
        std::is_same_v<T, float> ? 2e-6 : 0x1p-6);
}

// The cache as the attention reads it: K and V in T, or quantized (format) with their scales; `key` and `value`
// give each element's value as stored (dequantized), for the reference.
template <typename T>
struct TestCache {
  KVFormat format;
  std::vector<T> k, v;
  std::vector<int8_t> k8, v8;
  std::vector<fp8_e4m3> kf, vf;
  std::vector<float> k_scales, v_scales;
  KVCacheView view;

  TestCache(std::mt19937& rng, KVFormat format_, int64_t num_slots, int64_t KVH, int64_t D) : format(format_) {
    k = random_values<T>(rng, num_slots * KVH * D);
    v = random_values<T>(rng, num_slots * KVH * D);
    view.format = format;
    view.k = k.data();
    view.v = v.data();
    auto widen = [](T x) { return to_float(x); };
    if (format == KVFormat::kInt8) {
      k8.resize(k.size());
      v8.resize(v.size());
      k_scales.resize(num_slots * KVH);
      v_scales.resize(num_slots * KVH);
      for (int64_t r = 0; r < num_slots * KVH; ++r) {
        k_scales[r] = pagoda::kv_quant::int8_quantize_head(k.data() + r * D, k8.data() + r * D, D, widen);
        v_scales[r] = pagoda::kv_quant::int8_quantize_head(v.data() + r * D, v8.data() + r * D, D, widen);
      }
      view.k = k8.data();
      view.v = v8.data();
      view.k_scales = k_scales.data();
      view.v_scales = v_scales.data();
    } else if (format == KVFormat::kFp8) {
      view.k_scale = 0.004f;  // values in [-1, 1] as codes up to 250: e4m3's normal range
      view.v_scale = 0.01f;
      for (const T& x : k) kf.push_back(pagoda::kv_quant::fp8_quantize(to_float(x), view.k_scale));
      for (const T& x : v) vf.push_back(pagoda::kv_quant::fp8_quantize(to_float(x), view.v_scale));
      view.k = kf.data();
      view.v = vf.data();
    }
  }
  double key(int64_t e, int64_t D) const { return stored(k, k8, kf, k_scales, view.k_scale, e, D); }
  double value(int64_t e, int64_t D) const { return stored(v, v8, vf, v_scales, view.v_scale, e, D); }
  double stored(const std::vector<T>& plain, const std::vector<int8_t>& codes8, const std::vector<fp8_e4m3>& codesf,
                const std::vector<float>& scales, float scale, int64_t e, int64_t D) const {
    if (format == KVFormat::kInt8) return double(codes8[e]) * scales[e / D];
    if (format == KVFormat::kFp8) return double(pagoda::kv_quant::fp8_to_float(codesf[e])) * scale;
    return to_float(plain[e]);
  }
};

const char* format_name(KVFormat format) {
  return format == KVFormat::kInt8 ? " kv=int8" : format == KVFormat::kFp8 ? " kv=fp8" : "";
}

template <typename T>
void check_attention(std::mt19937& rng, int64_t H, int64_t KVH, int64_t D, int64_t window,
                     KVFormat format = KVFormat::kModel, float softcap = 0) {
  const int64_t B = 3, L = 40, num_slots = B * L + 5;
  const std::vector<int64_t> lens = {1, 17, L};
  const std::vector<T> q = random_values<T>(rng, B * H * D);
  const TestCache<T> cache(rng, format, num_slots, KVH, D);
  std::vector<int64_t> slots(B * L);
  for (int64_t i = 0; i < B * L; ++i) slots[i] = (i * 37 + 11) % num_slots;  // scattered, distinct
  std::vector<T> out(B * H * D);
  const float scale = 1.0f / std::sqrt(float(D));
  const int64_t tasks = B * KVH;
  kernels::dispatch_kv_format<T>(format, [&](auto element) {
    using KV = decltype(element);
    kernels::attend_tasks<T, KV>(q.data(), cache.view, slots.data(), lens.data(), out.data(), H, KVH, L, D, window,
                                 scale, softcap, 0, tasks / 2);
    kernels::attend_tasks<T, KV>(q.data(), cache.view, slots.data(), lens.data(), out.data(), H, KVH, L, D, window,
                                 scale, softcap, tasks / 2, tasks);
  });
  std::vector<double> want(B * H * D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / (H / KVH), first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      std::vector<double> scores;
      for (int64_t i = first; i < lens[b]; ++i) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += double(to_float(q[(b * H + h) * D + d])) * cache.key((slots[b * L + i] * KVH + kvh) * D + d, D);
        scores.push_back(softcap > 0 ? softcap * std::tanh(dot * scale / softcap) : dot * scale);
      }
      const double top = *std::max_element(scores.begin(), scores.end());
      double total = 0;
      for (auto& score : scores) total += (score = std::exp(score - top));
      for (int64_t d = 0; d < D; ++d) {
        double sum = 0;
        for (size_t i = 0; i < scores.size(); ++i)
          sum += scores[i] / total * cache.value((slots[b * L + first + int64_t(i)] * KVH + kvh) * D + d, D);
        want[(b * H + h) * D + d] = sum;
      }
    }
  // Outputs are convex combinations of values in [-1, 1]: fp32 sums of <= 128 terms, or bf16's rounding on store.
  // Against the dequantized values: the kernel applies each scale once per score or weight instead of per element.
  check(std::string("paged_decode_attention ") + type_name<T>() + " H=" + std::to_string(H) + " KVH=" +
            std::to_string(KVH) + " D=" + std::to_string(D) + " window=" + std::to_string(window) + format_name(format) +
            (softcap > 0 ? " softcap" : ""),
        out, want, std::is_same_v<T, float> ? 2e-6 : 0x1p-8, 0);
}

// Every e4m3 code but NaN: the vector widening equals the scalar one, and the scalar encoder maps it back to itself;
// halfway points between neighbours round to the even code.
void check_fp8_codes() {
  std::vector<double> want;
  std::vector<float> got;
  int64_t round_trip_failures = 0, tie_failures = 0;
  for (int bits = 0; bits < 256; ++bits) {
    if ((bits & 0x7F) == 0x7F) continue;
    const fp8_e4m3 code{static_cast<uint8_t>(bits)};
    fp8_e4m3 lanes[pagoda::simd::kLanes];
    for (auto& lane : lanes) lane = code;
    float widened[pagoda::simd::kLanes];
    pagoda::simd::Vec::load(lanes).store(widened);
    for (float lane : widened) got.push_back(lane);
    want.insert(want.end(), pagoda::simd::kLanes, pagoda::kv_quant::fp8_to_float(code));
    if (pagoda::kv_quant::fp8_from_float(pagoda::kv_quant::fp8_to_float(code)).bits != bits) ++round_trip_failures;
    if ((bits & 0x7F) < 0x7E && !(bits & 0x80)) {
      const float low = pagoda::kv_quant::fp8_to_float(code);
      const float high = pagoda::kv_quant::fp8_to_float(fp8_e4m3{static_cast<uint8_t>(bits + 1)});
      const uint8_t even = (bits & 1) ? bits + 1 : bits;
      if (pagoda::kv_quant::fp8_from_float((low + high) / 2).bits != even) ++tie_failures;
    }
  }
  check("fp8 widening", got, want, 0, 0);
  check("fp8 round trip", std::vector<float>{float(round_trip_failures), float(tie_failures)},
        std::vector<double>{0, 0}, 0, 0);
}

template <typename T>
void check_type(std::mt19937& rng) {
  for (int64_t n : {64, 100}) {
    check_add_rms_norm<T>(rng, 3, n, true);
    check_add_rms_norm<T>(rng, 3, n, false);
  }
  for (int64_t D : {64, 20}) check_rotary<T>(rng, 3, 4, 2, D);
  for (int64_t I : {64, 37}) check_silu_mul<T>(rng, 2, I);
  for (int64_t D : {64, 128}) {
    check_attention<T>(rng, 4, 4, D, 0);
    check_attention<T>(rng, 8, 2, D, 0);
    check_attention<T>(rng, 8, 2, D, 8);
    for (KVFormat format : {KVFormat::kInt8, KVFormat::kFp8}) {
      check_attention<T>(rng, 8, 2, D, 0, format);
      check_attention<T>(rng, 4, 4, D, 8, format);
    }
    // A cap below the scores' spread, so tanh bends them (Gemma 2 caps at 50 scores that reach hundreds).
    check_attention<T>(rng, 8, 2, D, 8, KVFormat::kModel, 0.3f);
    check_attention<T>(rng, 8, 2, D, 0, KVFormat::kInt8, 0.3f);
  }
  using GemvWeight = std::conditional_t<std::is_same_v<T, float>, float, bf16>;
  for (int64_t M : {1, 2, 3, 4, 5, 9, 19})
    for (int64_t K : {32, 96}) check_gemv<GemvWeight>(rng, M, K, 37);
  check_gemv<GemvWeight>(rng, 7, 4096, 150);  // several L2 tiles per channel range

}


}  // namespace

int main() {
  std::printf("target: %s, %d fp32 lanes\n", architecture(), pagoda::simd::kLanes);
  std::mt19937 rng(20240917);
  check_bf16_rounding();
  check_fp8_codes();
  check_type<float>(rng);
  check_type<bf16>(rng);
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
