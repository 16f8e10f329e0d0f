// LoRA deltas for decode rows, written once over cpu_simd.h's vector (the torch-free core of simd_lora.cpp):
// y[m, n] += sum_r (scale[m] * sum_k x[m, k] A[s_m, r, k]) * Bt[s_m, r, n], each row m with its own adapter slot
// s_m. Only the rows' own slots are read: an adapter row costs its rank, not every slot's. Two passes:
//   shrink  t[m, r] = scale[m] * (A[s_m, r] . x[m]): rank dot products a row, fp32 sums of x and A widened.
//   expand  y[m, n0:n1] += t[m] . Bt[s_m, :, n0:n1]: B stored transposed ([slots, rank, out]) so each output
//           vector is rank FMAs of contiguous loads and no reduction; y widened, one rounding on store.
#pragma once

#include <cstdint>

#include "cpu_simd.h"

namespace pagoda::simd_kernels {

using simd::kLanes;
using simd::Vec;

// a . x over K elements in fp32 lanes (the tail zero-filled); T is float or bf16.
template <typename T>
float dot(const T* a, const T* x, int64_t K) {
  Vec sum = Vec::zero();
  for (int64_t k = 0; k < K; k += kLanes) sum = fmadd(simd::load_at(a, k, K), simd::load_at(x, k, K), sum);
  return sum.reduce_add();
}

// t[rank] = scale * (A_slot x): a_slot [rank, K], x [K].
template <typename T>
void lora_shrink(const T* x, const T* a_slot, int64_t K, int64_t rank, float scale, float* t) {
  for (int64_t r = 0; r < rank; ++r) t[r] = scale * dot(a_slot + r * K, x, K);
}

// y[n] += sum_r t[r] * bt_slot[r, n] for n in [begin, end): bt_slot [rank, N], y one row of the output.
template <typename T>
void lora_expand(const float* t, const T* bt_slot, int64_t rank, int64_t N, T* y, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; n += kLanes) {
    Vec sum = simd::load_at(y, n, end);
    for (int64_t r = 0; r < rank; ++r) {
      sum = fmadd(simd::load_at(bt_slot + r * N, n, end), Vec::broadcast(t[r]), sum);
    }
    simd::store_at(y, n, end, sum);
  }
}

}  // namespace pagoda::simd_kernels
