// The small steps between a decoder layer's matmuls, fused (residual add + RMSNorm, rotary + KV-cache write,
// the SiLU-gated product), written once over cpu_simd.h's vector: the torch-free core of simd_fused.cpp, the
// AVX2 module's form of cpu_fused.cpp's operations, with the same numerics contract. Every intermediate that
// torch rounds to the model dtype is rounded here too (round_as<T>), and nothing is contracted into an FMA that
// torch computes as a separate multiply and add (builds pass -ffp-contract=off); what can differ from torch is
// the order of the RMS sum and the last bit of exp, as between any two fp32 reductions.
// Each function computes rows [begin, end); disjoint ranges may run on separate threads.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_simd.h"
#include "kv_quant.h"

namespace pagoda::simd_kernels {

// x[r] += delta[r] (rounded to T, as torch's add; skipped when delta is null), then
// out[r] = weight * T(x[r] / rms(x[r])), for rows of n.
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t n, float eps, int64_t begin,
                       int64_t end) {
  using simd::load_at;
  using simd::round_as;
  using simd::store_at;
  using simd::Vec;
  for (int64_t r = begin; r < end; ++r) {
    T* row = x + r * n;
    Vec squares = Vec::zero();
    for (int64_t i = 0; i < n; i += simd::kLanes) {
      Vec v = load_at(row, i, n);
      if (delta != nullptr) {
        v = round_as<T>(v + load_at(delta + r * n, i, n));
        store_at(row, i, n, v);
      }
      squares = fmadd(v, v, squares);
    }
    const Vec inv_rms = Vec::broadcast(1.0f / std::sqrt(squares.reduce_add() / n + eps));
    for (int64_t i = 0; i < n; i += simd::kLanes) {
      const Vec normed = round_as<T>(load_at(row, i, n) * inv_rms);
      store_at(out + r * n, i, n, load_at(weight, i, n) * normed);
    }
  }
}

// One head, rotated in place: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (halves, as HF's
// rotate_half), each product and the sum rounded to T as torch's mul, mul, add would.
template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
  using simd::load_at;
  using simd::round_as;
  using simd::Vec;
  for (int64_t i = 0; i < half; i += simd::kLanes) {
    const Vec x1 = load_at(x, i, half), x2 = load_at(x + half, i, half);
    const Vec first = round_as<T>(x1 * load_at(cos, i, half)) - round_as<T>(x2 * load_at(sin, i, half));
    const Vec second = round_as<T>(x2 * load_at(cos + half, i, half)) + round_as<T>(x1 * load_at(sin + half, i, half));
    simd::store_at(x, i, half, first);
    simd::store_at(x + half, i, half, second);
  }
}

// qkv rows [tokens, H + 2 KVH, D]: q and k heads rotated in place (cos, sin [tokens, D]), then k and v stored
// at their slots of the cache [slots, KVH, D] in its format (kv_quant.h: copied, or quantized).
template <typename T>
void rotary_write_kv_rows(T* qkv, const T* cos, const T* sin, const kv_quant::KVCacheView& cache,
                          const int64_t* slots, int64_t H, int64_t KVH, int64_t D, int64_t begin, int64_t end) {
  const int64_t row_elements = (H + 2 * KVH) * D;
  for (int64_t t = begin; t < end; ++t) {
    T* row = qkv + t * row_elements;
    for (int64_t h = 0; h < H + KVH; ++h) rotate_head(row + h * D, cos + t * D, sin + t * D, D / 2);
    kv_quant::write_token(cache, row + H * D, row + (H + KVH) * D, slots[t], KVH, D,
                          [](T x) { return simd::widen(x); });
  }
}

// out[r] = T(silu(gate)) * up, with gate_up[r] = [gate | up] (each I wide). silu(g) = g * sigmoid(g),
// from e = exp(-|g|) <= 1 so that nothing overflows.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t I, int64_t begin, int64_t end) {
  using simd::load_at;
  using simd::Vec;
  const Vec one = Vec::broadcast(1.0f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gate_up + r * 2 * I;
    for (int64_t i = 0; i < I; i += simd::kLanes) {
      const Vec g = load_at(gate, i, I);
      const Vec e = simd::exp_nonpositive(Vec::zero() - abs(g));
      const Vec numerator = where_negative(g, g * e, g);  // g >= 0: g; g < 0: g e
      const Vec silu = simd::round_as<T>(numerator / (one + e));
      simd::store_at(out + r * I, i, I, silu * load_at(gate + I, i, I));
    }
  }
}

}  // namespace pagoda::simd_kernels
