// Helpers shared by the CPU kernels: 16 fp32 lanes loaded from, and stored to, fp32 or bf16 memory
// (bf16 stores round to nearest even, as torch's conversion does), loaded from a quantized KV cache's int8 or
// e4m3 codes (cpu_simd.h's conversions, exact), and a vectorised exp.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include "cpu_simd.h"

namespace pagoda {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) { return simd::Vec::load(p).v; }
inline __m512 load16(const kv_quant::fp8_e4m3* p) { return simd::Vec::load(p).v; }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

using simd::prefetch_line_into_l1;
using simd::prefetch_line_into_l2;

// The first `count` lanes (all 16 when count >= 16): the mask for a row's tail.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 live) {
  __m256i raw = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v, __mmask16 live) { _mm512_mask_storeu_ps(p, live, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 live) {
  _mm256_mask_storeu_epi16(p, live, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// v rounded to T and back: where torch's op on T-typed tensors would round an intermediate.
template <typename T> inline __m512 round_as(__m512 v);
template <> inline __m512 round_as<float>(__m512 v) { return v; }
template <> inline __m512 round_as<at::BFloat16>(__m512 v) {
  __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a
// degree-6 polynomial (relative error ~2e-7); below -87 the result flushes to 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pagoda
