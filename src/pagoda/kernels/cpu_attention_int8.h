// The int8 KV cache's integer scoring in the AVX-512 decode attention (cpu_attention.cpp): keys scored with
// vpdpwssd (int16 pairs multiplied and added into int32 lanes) instead of widening every code to fp32 for FMAs,
// which left the kernel bound by instructions rather than by the bytes int8 saves. Each head's query is rounded
// to int16 with its own scale: 2^-16 of its largest element, far below the codes' own error. Head dims a multiple
// of 32 (C even). (Summing the values the same way, the weights rounded to int16, measured no faster: the values
// stay in fp32.)
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagoda {

constexpr int kMaxGroup = 16;  // query heads per kv head

// Sums each of 16 vectors: lane j of the result is the sum of v[j]'s lanes. 15 adds instead of 16
// separate horizontal reductions.
inline __m512 transpose_sum16(__m512 v[16]) {
  // Round 1: pairs (2i, 2i+1) -> lanes interleaved, each lane a sum of 2 of the original 16 lanes.
  __m512 a[8];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // Round 2: 64-bit interleave of pairs of the above.
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Rounds 3-4: 128-bit lanes. After round 2, b[i] holds, in each 128-bit lane l, partial sums of
  // vectors 4i..4i+3 over lane l; fold lanes together with shuffles across the 128-bit lanes.
  __m512 c[2];
  for (int i = 0; i < 2; ++i) {
    __m512 lo = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    __m512 hi = _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    c[i] = _mm512_add_ps(lo, hi);
  }
  __m512 lo = _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0));
  __m512 hi = _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_add_ps(lo, hi);
}

// x [G, D] (G rows of D fp32) as int16 codes with a scale per row (amax / 32767; an all-zero row: scale 1).
template <int64_t D>
inline void int16_rows(const float* x, int64_t G, int16_t* codes, float* scales) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + g * D + d)));
    const float top = _mm512_reduce_max_ps(amax);
    scales[g] = top > 0.0f ? top / 32767.0f : 1.0f;
    const __m512 inverse = _mm512_set1_ps(1.0f / scales[g]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + g * D + d), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * D + d), _mm512_cvtsepi32_epi16(rounded));
    }
  }
}

// Scores [G, n] of the task's int8 keys (rows: their slots; offset: the head's in a row): the queries [G, D] as
// int16, a block of 16 keys' codes widened to int16 once, vpdpwssd summing code x query pairs in int32 (each lane
// at most 8 x 127 x 32767 < 2^25: exact, and exact in fp32); a score is that sum times the query's and the key's
// scale.
template <int C, typename Prefetch>
void score_int8_keys(const float* queries, const int8_t* k_cache, const int64_t* rows, int64_t n, int64_t stride,
                     int64_t offset, const float* key_scales, int64_t G, float* scores, const Prefetch& prefetch_block,
                     int64_t next_count) {
  constexpr int64_t D = 16 * C, P = D / 32;
  alignas(64) int16_t q16[kMaxGroup * D];
  float q_scales[kMaxGroup];
  int16_rows<D>(queries, G, q16, q_scales);
  alignas(64) int16_t tile[16 * D];
  auto widen = [&](int64_t i, int j) {
    const int8_t* key = k_cache + rows[i] * stride + offset;
    for (int p = 0; p < P; ++p)
      _mm512_store_si512(tile + j * D + p * 32,
                         _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + p * 32))));
  };
  auto dot = [&](int j, int64_t g) {
    __m512i acc = _mm512_setzero_si512();
    for (int p = 0; p < P; ++p)
      acc = _mm512_dpwssd_epi32(acc, _mm512_load_si512(tile + j * D + p * 32), _mm512_load_si512(q16 + g * D + p * 32));
    return _mm512_cvtepi32_ps(acc);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_block(i, i + 16);
    for (int j = 0; j < 16; ++j) widen(i + j, j);
    const __m512 key_scale = _mm512_loadu_ps(key_scales + i);
    for (int64_t g = 0; g < G; ++g) {
      __m512 partial[16];
      for (int j = 0; j < 16; ++j) partial[j] = dot(j, g);
      const __m512 scale = _mm512_mul_ps(key_scale, _mm512_set1_ps(q_scales[g]));
      _mm512_storeu_ps(scores + g * n + i, _mm512_mul_ps(transpose_sum16(partial), scale));
    }
  }
  prefetch_block(i, std::max(n, next_count));  // the tail, and the rest of a longer next task
  for (; i < n; ++i) {
    widen(i, 0);
    for (int64_t g = 0; g < G; ++g) scores[g * n + i] = _mm512_reduce_add_ps(dot(0, g)) * (key_scales[i] * q_scales[g]);
  }
}

}  // namespace pagoda
