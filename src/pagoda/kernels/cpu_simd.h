// A portable layer over one SIMD register of fp32 lanes, so that a kernel is written once (the simd_*.cpp
// sources) and compiled for each target: `Vec` is AVX-512's 16 lanes when the build enables AVX-512F, else
// AVX2 + FMA's 8. bf16 memory is widened to fp32 on load and rounded to nearest even on store (NaN to 0x7FC0),
// as c10::BFloat16's conversion does, so no target needs native bf16 arithmetic.
//
// Every operation is one IEEE fp32 operation per lane (fmadd: one rounding), identical on every target;
// only reductions (reduce_add, reduce_max) depend on the lane count, through their order.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagoda::simd {

#if defined(__AVX512F__)

struct Vec {
  static constexpr int kLanes = 16;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  // 2 * kLanes bf16 as fp32: even receives elements 0, 2, 4, ..., odd 1, 3, 5, ... (a shift and a mask of one
  // load, no shuffle: bf16 is the upper half of fp32).
  static void load_pairs(const at::BFloat16* p, Vec& even, Vec& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(at::BFloat16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }

  // The 16 lanes rounded to bf16 bit patterns (round to nearest even; NaN -> 0x7FC0).
  __m256i bf16_bits() const {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  }

  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
};

inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
inline Vec round_to_integer(Vec a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for integral n in -126..127, exactly.
inline Vec exp2_integer(Vec n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// a where a < 0, else b.
inline Vec where_negative(Vec a, Vec if_negative, Vec otherwise) {
  return {_mm512_mask_mov_ps(otherwise.v, _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_LT_OQ), if_negative.v)};
}

#elif defined(__AVX2__) && defined(__FMA__)

struct Vec {
  static constexpr int kLanes = 8;
  __m256 v;

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  // 2 * kLanes bf16 as fp32: even receives elements 0, 2, 4, ..., odd 1, 3, 5, ... (a shift and a mask of one
  // load, no shuffle: bf16 is the upper half of fp32).
  static void load_pairs(const at::BFloat16* p, Vec& even, Vec& odd) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(at::BFloat16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }

  // The 8 lanes rounded to bf16 bit patterns (round to nearest even; NaN -> 0x7FC0).
  __m128i bf16_bits() const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // Every lane is at most 0xFFFF, so the unsigned saturating pack is exact; it packs within 128-bit halves.
    const __m256i packed = _mm256_packus_epi32(rounded, rounded);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
  }

  float reduce_add() const {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
  }
  float reduce_max() const {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  }
};

inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec abs(Vec a) { return {_mm256_and_ps(a.v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)))}; }
inline Vec round_to_integer(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in -126..127, exactly.
inline Vec exp2_integer(Vec n) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
}
// a where a < 0, else b.
inline Vec where_negative(Vec a, Vec if_negative, Vec otherwise) {
  return {_mm256_blendv_ps(otherwise.v, if_negative.v, _mm256_cmp_ps(a.v, _mm256_setzero_ps(), _CMP_LT_OQ))};
}

#else
#error "cpu_simd.h needs AVX-512F, or AVX2 with FMA"
#endif

constexpr int kLanes = Vec::kLanes;

// One cache line into L2. As inline asm, not _mm_prefetch: GCC deletes a loop whose body is only
// _mm_prefetch calls (they have no side effects).
inline void prefetch_line_into_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// The first `count` (< kLanes) elements, the rest zero: a row's tail, through a buffer (tails are rare and short).
template <typename T>
inline Vec load_first(const T* p, int64_t count) {
  T buffer[kLanes] = {};
  std::memcpy(buffer, p, count * sizeof(T));
  return Vec::load(buffer);
}
template <typename T>
inline void store_first(T* p, Vec v, int64_t count) {
  T buffer[kLanes];
  v.store(buffer);
  std::memcpy(p, buffer, count * sizeof(T));
}
// Lanes [i, i + kLanes) of a row of n, or its tail.
template <typename T>
inline Vec load_at(const T* row, int64_t i, int64_t n) {
  return i + kLanes <= n ? Vec::load(row + i) : load_first(row + i, n - i);
}
template <typename T>
inline void store_at(T* row, int64_t i, int64_t n, Vec v) {
  if (i + kLanes <= n) {
    v.store(row + i);
  } else {
    store_first(row + i, v, n - i);
  }
}

// v rounded to T and back: where torch's op on T-typed tensors would round an intermediate.
template <typename T> inline Vec round_as(Vec v);
template <> inline Vec round_as<float>(Vec v) { return v; }
template <> inline Vec round_as<at::BFloat16>(Vec v) {
  at::BFloat16 buffer[kLanes];
  v.store(buffer);
  return Vec::load(buffer);
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6
// polynomial (relative error ~2e-7); below -87 the result flushes to 0 (2^-126 p(r), as good as 0 here).
inline Vec exp_nonpositive(Vec x) {
  x = max(x, Vec::broadcast(-87.0f));
  const Vec n = round_to_integer(x * Vec::broadcast(1.44269504088896341f));
  Vec r = fnmadd(n, Vec::broadcast(0.693359375f), x);
  r = fnmadd(n, Vec::broadcast(-2.12194440e-4f), r);
  Vec p = Vec::broadcast(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = fmadd(p, r, Vec::broadcast(c));
  return p * exp2_integer(n);
}

}  // namespace pagoda::simd
