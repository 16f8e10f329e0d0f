// A portable layer over a vector of fp32 lanes, so that a kernel is written once (the simd_*.h cores) and
// compiled for each target: `Vec` is AVX-512's 16 lanes when the build enables AVX-512F, AVX2 + FMA's 8, or on
// aarch64 two NEON registers as 8 lanes. bf16 memory is widened to fp32 on load and rounded to nearest even on
// store (NaN to 0x7FC0), as c10::BFloat16's conversion does, so no target needs native bf16 arithmetic.
//
// Every operation is one IEEE fp32 operation per lane (fmadd: one rounding), identical on every target;
// only reductions (reduce_add, reduce_max) depend on the lane count, through their order, which the two
// 8-lane forms share. Torch-free, so the cores are tested natively and under qemu-aarch64 (tests/native/).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <cstdint>
#include <cstring>

#include "kv_quant.h"

namespace pagoda::simd {

using kv_quant::fp8_e4m3;

// bf16 in memory: the upper 16 bits of an fp32, c10::BFloat16's layout (simd_tensors.h casts tensors to it).
struct bf16 {
  uint16_t bits;
};

#if defined(__AVX512F__)

struct Vec {
  static constexpr int kLanes = 16;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // e4m3 codes, exactly (kv_quant::fp8_to_float): a normal's bits moved into fp32's, a subnormal converted.
  static Vec load(const fp8_e4m3* p) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i magnitude = _mm512_and_si512(codes, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.0f / 512));
    const __m512 value = _mm512_mask_mov_ps(normal, _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8)), subnormal);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24);
    return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign))};
  }
  // 2 * kLanes bf16 as fp32: even receives elements 0, 2, 4, ..., odd 1, 3, 5, ... (a shift and a mask of one
  // load, no shuffle: bf16 is the upper half of fp32).
  static void load_pairs(const bf16* p, Vec& even, Vec& odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even = {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16))};
    odd = {_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }

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
  static Vec load(const bf16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  // e4m3 codes, exactly (kv_quant::fp8_to_float): a normal's bits moved into fp32's, a subnormal converted.
  static Vec load(const fp8_e4m3* p) {
    const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(0x7F));
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512));
    const __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
    const __m256 value = _mm256_blendv_ps(normal, subnormal, is_subnormal);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)), 24);
    return {_mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign))};
  }
  // 2 * kLanes bf16 as fp32: even receives elements 0, 2, 4, ..., odd 1, 3, 5, ... (a shift and a mask of one
  // load, no shuffle: bf16 is the upper half of fp32).
  static void load_pairs(const bf16* p, Vec& even, Vec& odd) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }

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

#elif defined(__aarch64__) && defined(__ARM_NEON)

// x86's max: a where a > b, else b (b when either is NaN), so that every target's max agrees.
inline float32x4_t max_of(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }

// 8 lanes in two 128-bit registers, so that a kernel's steps, tails and reduction order are AVX2's.
struct Vec {
  static constexpr int kLanes = 8;
  float32x4_t lo, hi;

  static Vec zero() { return broadcast(0.0f); }
  static Vec broadcast(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
  static Vec load(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
  static Vec load(const bf16* p) {
    const uint16x8_t raw = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
    return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(raw), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(raw, 16))};
  }
  static Vec load(const int8_t* p) {
    const int16x8_t wide = vmovl_s8(vld1_s8(p));
    return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_high_s16(wide))};
  }
  // e4m3 codes, exactly (kv_quant::fp8_to_float): a normal's bits moved into fp32's, a subnormal converted.
  static float32x4_t fp8_lanes(uint32x4_t codes) {
    const uint32x4_t magnitude = vandq_u32(codes, vdupq_n_u32(0x7F));
    const float32x4_t normal = vreinterpretq_f32_u32(vaddq_u32(vshlq_n_u32(magnitude, 20), vdupq_n_u32(120u << 23)));
    const float32x4_t subnormal = vmulq_f32(vcvtq_f32_u32(magnitude), vdupq_n_f32(1.0f / 512));
    const float32x4_t value = vbslq_f32(vcltq_u32(magnitude, vdupq_n_u32(8)), subnormal, normal);
    const uint32x4_t sign = vshlq_n_u32(vandq_u32(codes, vdupq_n_u32(0x80)), 24);
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(value), sign));
  }
  static Vec load(const fp8_e4m3* p) {
    const uint16x8_t wide = vmovl_u8(vld1_u8(reinterpret_cast<const uint8_t*>(p)));
    return {fp8_lanes(vmovl_u16(vget_low_u16(wide))), fp8_lanes(vmovl_high_u16(wide))};
  }
  // 2 * kLanes bf16 as fp32: even receives elements 0, 2, 4, ..., odd 1, 3, 5, ... (as the x86 forms).
  static void load_pairs(const bf16* p, Vec& even, Vec& odd) {
    const uint32x4_t lo = vld1q_u32(reinterpret_cast<const uint32_t*>(p));
    const uint32x4_t hi = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4);
    const uint32x4_t upper = vdupq_n_u32(0xFFFF0000u);
    even = {vreinterpretq_f32_u32(vshlq_n_u32(lo, 16)), vreinterpretq_f32_u32(vshlq_n_u32(hi, 16))};
    odd = {vreinterpretq_f32_u32(vandq_u32(lo, upper)), vreinterpretq_f32_u32(vandq_u32(hi, upper))};
  }
  void store(float* p) const {
    vst1q_f32(p, lo);
    vst1q_f32(p + 4, hi);
  }
  void store(bf16* p) const {
    vst1q_u16(reinterpret_cast<uint16_t*>(p), vcombine_u16(bf16_bits(lo), bf16_bits(hi)));
  }

  // 4 lanes rounded to bf16 bit patterns (round to nearest even; NaN -> 0x7FC0).
  static uint16x4_t bf16_bits(float32x4_t v) {
    const uint32x4_t bits = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7FFF))), 16);
    return vmovn_u32(vbslq_u32(vceqq_f32(v, v), rounded, vdupq_n_u32(0x7FC0)));
  }

  // (h0 + h2) + (h1 + h3) with h = lo + hi: AVX2's order.
  float reduce_add() const {
    const float32x4_t half = vaddq_f32(lo, hi);
    const float32x4_t pairs = vaddq_f32(half, vextq_f32(half, half, 2));
    return vgetq_lane_f32(pairs, 0) + vgetq_lane_f32(pairs, 1);
  }
  float reduce_max() const {
    const float32x4_t half = max_of(lo, hi);
    const float32x4_t pairs = max_of(half, vextq_f32(half, half, 2));
    const float a = vgetq_lane_f32(pairs, 0), b = vgetq_lane_f32(pairs, 1);
    return a > b ? a : b;
  }
};

inline Vec operator+(Vec a, Vec b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline Vec operator-(Vec a, Vec b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline Vec operator*(Vec a, Vec b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline Vec operator/(Vec a, Vec b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {max_of(a.lo, b.lo), max_of(a.hi, b.hi)}; }
inline Vec abs(Vec a) { return {vabsq_f32(a.lo), vabsq_f32(a.hi)}; }
inline Vec round_to_integer(Vec a) { return {vrndnq_f32(a.lo), vrndnq_f32(a.hi)}; }
// 2^n for integral n in -126..127, exactly.
inline float32x4_t exp2_integer(float32x4_t n) {
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
inline Vec exp2_integer(Vec n) { return {exp2_integer(n.lo), exp2_integer(n.hi)}; }
// a where a < 0, else b.
inline Vec where_negative(Vec a, Vec if_negative, Vec otherwise) {
  const float32x4_t zero = vdupq_n_f32(0.0f);
  return {vbslq_f32(vcltq_f32(a.lo, zero), if_negative.lo, otherwise.lo),
          vbslq_f32(vcltq_f32(a.hi, zero), if_negative.hi, otherwise.hi)};
}

#else
#error "cpu_simd.h needs AVX-512F, AVX2 with FMA, or aarch64's NEON"
#endif

constexpr int kLanes = Vec::kLanes;

// One cache line into L1 (and L2), or into L2. As inline asm, not a builtin: GCC deletes a loop whose body is
// only prefetches (they have no side effects).
#if defined(__x86_64__)
inline void prefetch_line_into_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_line_into_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }
#else
inline void prefetch_line_into_l1(const void* p) { asm volatile("prfm pldl1keep, %0" : : "Q"(*static_cast<const char*>(p))); }
inline void prefetch_line_into_l2(const void* p) { asm volatile("prfm pldl2keep, %0" : : "Q"(*static_cast<const char*>(p))); }
#endif

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

// One element as fp32 (the kv_quant.h writers' `widen`).
inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// v rounded to T and back: where torch's op on T-typed tensors would round an intermediate.
template <typename T> inline Vec round_as(Vec v);
template <> inline Vec round_as<float>(Vec v) { return v; }
template <> inline Vec round_as<bf16>(Vec v) {
  bf16 buffer[kLanes];
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

// cap * tanh(score / cap) on each of a row's n scores, in place (Gemma 2's soft-capped attention scores):
// tanh(t) = (1 - e) / (1 + e) signed as t, e = exp(-2|t|) <= 1; off from tanh by ~2e-7 absolute (exp's error).
inline void soft_cap(float* row, int64_t n, float cap) {
  const Vec c = Vec::broadcast(cap), one = Vec::broadcast(1.0f), minus_two = Vec::broadcast(-2.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec t = load_at(row, i, n) / c;
    const Vec e = exp_nonpositive(minus_two * abs(t));
    const Vec magnitude = (one - e) / (one + e) * c;
    store_at(row, i, n, where_negative(t, Vec::zero() - magnitude, magnitude));
  }
}

}  // namespace pagoda::simd
