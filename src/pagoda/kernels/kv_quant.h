// The KV cache's storage formats as the kernels write and read them (pagoda/kv_format.py, model/kv_cache.py):
// the model's dtype; int8 codes with an fp32 scale per token and KV head (amax / 127) in a [slots, KVH] tensor
// beside them; or e4m3 codes (torch.float8_e4m3fn) of x / the layer's scale. Torch-free and scalar: both
// modules' rotary + KV write (cpu_fused.cpp, simd_fused.h) quantize through here, one token's heads at a time,
// rounding as model/kv_cache.py's torch quantizers do (x / scale in fp32, ties to even), so that the native and
// the reference writers leave the same bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagoda::kv_quant {

// An e4m3 code (no infinities; the NaN codes 0x7F / 0xFF are never written), c10::Float8_e4m3fn's layout.
struct fp8_e4m3 {
  uint8_t bits;
};

constexpr float kFp8Max = 448.0f;
constexpr float kInt8Max = 127.0f;

enum class KVFormat { kModel, kInt8, kFp8 };

// One layer's cache as the kernels see it: K and V [slots, KVH, D] of `format`'s element (the model's dtype,
// int8_t or fp8_e4m3), int8's scales [slots, KVH] (else null), fp8's layer scales (else 1).
struct KVCacheView {
  KVFormat format = KVFormat::kModel;
  void* k = nullptr;
  void* v = nullptr;
  float* k_scales = nullptr;
  float* v_scales = nullptr;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// x (finite, within +-448) as e4m3, rounded to nearest, ties to even.
inline fp8_e4m3 fp8_from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float magnitude = std::fabs(x);
  if (!(magnitude >= 0.015625f)) {
    // Below the smallest normal, 2^-6: a multiple of 2^-9 (8 of them is the smallest normal, whose code is 8).
    return {static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f)))};
  }
  uint32_t rounded = bits & 0x7FFFFFFFu;
  rounded += 0x7FFFFu + ((rounded >> 20) & 1u);  // to 3 mantissa bits, ties to even (a carry bumps the exponent)
  const uint32_t code = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u);  // exponent bias 127 -> 7
  return {static_cast<uint8_t>(sign | std::min<uint32_t>(code, 0x7Eu))};
}

inline float fp8_to_float(fp8_e4m3 code) {
  const uint32_t magnitude = code.bits & 0x7Fu;
  float value;
  if (magnitude < 8) {
    value = static_cast<float>(magnitude) / 512.0f;
  } else {
    const uint32_t bits = (magnitude << 20) + (120u << 23);
    std::memcpy(&value, &bits, sizeof(value));
  }
  return (code.bits & 0x80u) ? -value : value;
}

// x / scale clamped to e4m3's range (a NaN to 448), as an e4m3 code.
inline fp8_e4m3 fp8_quantize(float x, float scale) {
  return fp8_from_float(std::max(-kFp8Max, std::min(kFp8Max, x / scale)));
}

// One head's D values as symmetric int8 codes; returns the scale, amax / 127 (0 for an all-zero head, codes 0).
template <typename T, typename Widen>
float int8_quantize_head(const T* x, int8_t* codes, int64_t D, Widen widen) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(widen(x[d])));
  const float scale = amax / kInt8Max;
  for (int64_t d = 0; d < D; ++d) {
    const float code = scale > 0.0f ? std::nearbyint(widen(x[d]) / scale) : 0.0f;
    codes[d] = static_cast<int8_t>(std::max(-kInt8Max, std::min(kInt8Max, code)));
  }
  return scale;
}

// One token's K and V heads (KVH x D each, of T) stored at `slot` in the cache's format; widen: T -> float.
template <typename T, typename Widen>
void write_token(const KVCacheView& cache, const T* k, const T* v, int64_t slot, int64_t KVH, int64_t D,
                 Widen widen) {
  const int64_t offset = slot * KVH * D;
  switch (cache.format) {
    case KVFormat::kModel:
      std::memcpy(static_cast<T*>(cache.k) + offset, k, KVH * D * sizeof(T));
      std::memcpy(static_cast<T*>(cache.v) + offset, v, KVH * D * sizeof(T));
      return;
    case KVFormat::kInt8:
      for (int64_t h = 0; h < KVH; ++h) {
        cache.k_scales[slot * KVH + h] = int8_quantize_head(k + h * D, static_cast<int8_t*>(cache.k) + offset + h * D,
                                                            D, widen);
        cache.v_scales[slot * KVH + h] = int8_quantize_head(v + h * D, static_cast<int8_t*>(cache.v) + offset + h * D,
                                                            D, widen);
      }
      return;
    case KVFormat::kFp8:
      for (int64_t e = 0; e < KVH * D; ++e) {
        static_cast<fp8_e4m3*>(cache.k)[offset + e] = fp8_quantize(widen(k[e]), cache.k_scale);
        static_cast<fp8_e4m3*>(cache.v)[offset + e] = fp8_quantize(widen(v[e]), cache.v_scale);
      }
      return;
  }
}

}  // namespace pagoda::kv_quant
