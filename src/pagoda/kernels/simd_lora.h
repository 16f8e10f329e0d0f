// LoRA deltas for decode rows, written once over cpu_simd.h's vector (the torch-free core of simd_lora.cpp):
// y[m, n] += sum_r (scale[m] * sum_k x[m, k] A[s_m, r, k]) * Bt[s_m, r, n], each row m with its own adapter slot
// s_m. Only the rows' own slots are read: an adapter row costs its rank, not every slot's. Two passes:
//   shrink  t[m, r] = scale[m] * (A[s_m, r] . x[m]): rank dot products a row, fp32 sums of x and A widened.
//   expand  y[m, n0:n1] += t[m] . Bt[s_m, :, n0:n1]: B stored transposed ([slots, rank, out]) so each output
//           vector is rank FMAs of contiguous loads and no reduction; y widened, one rounding on store.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"

namespace pagoda::simd_kernels {

using simd::kLanes;
using simd::Vec;

inline float to_float(float v) { return v; }
inline float to_float(simd::bf16 v) {
  float out;
  const uint32_t bits = uint32_t(v.bits) << 16;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// a . x over K elements, fp32 lanes then the tail; T is float or bf16.
template <typename T>
float dot(const T* a, const T* x, int64_t K) {
  Vec sum = Vec::zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) sum = fmadd(Vec::load(a + k), Vec::load(x + k), sum);
  float total = sum.reduce_add();
  for (; k < K; ++k) total += to_float(a[k]) * to_float(x[k]);
  return total;
}

// t[rank] = scale * (A_slot x): a_slot [rank, K], x [K].
template <typename T>
void lora_shrink(const T* x, const T* a_slot, int64_t K, int64_t rank, float scale, float* t) {
  for (int64_t r = 0; r < rank; ++r) t[r] = scale * dot(a_slot + r * K, x, K);
}

// y[n] += sum_r t[r] * bt_slot[r, n] for n in [begin, end): bt_slot [rank, N], y one row of the output.
template <typename T>
void lora_expand(const float* t, const T* bt_slot, int64_t rank, int64_t N, T* y, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kLanes <= end; n += kLanes) {
    Vec sum = Vec::load(y + n);
    for (int64_t r = 0; r < rank; ++r) sum = fmadd(Vec::load(bt_slot + r * N + n), Vec::broadcast(t[r]), sum);
    sum.store(y + n);
  }
  for (; n < end; ++n) {
    float sum = to_float(y[n]);
    for (int64_t r = 0; r < rank; ++r) sum += to_float(bt_slot[r * N + n]) * t[r];
    if constexpr (std::is_same_v<T, float>) {
      y[n] = sum;
    } else {
      float lanes[kLanes] = {sum};
      T rounded[kLanes];
      Vec::load(lanes).store(rounded);
      y[n] = rounded[0];
    }
  }
}

}  // namespace pagoda::simd_kernels
