// The torch side of the simd_*.h cores: a tensor's elements as the cores' types (at::BFloat16 as
// cpu_simd.h's bf16, the same 16 bits), so that the cores stay torch-free.
#pragma once

#include <torch/extension.h>

#include <type_traits>

#include "cpu_simd.h"

namespace pagoda::simd_kernels {

static_assert(sizeof(at::BFloat16) == sizeof(simd::bf16) && alignof(at::BFloat16) == alignof(simd::bf16),
              "cpu_simd.h's bf16 must have c10::BFloat16's layout");

template <typename T>
using CoreType = std::conditional_t<std::is_same_v<T, at::BFloat16>, simd::bf16, T>;

// t's data as the core's element type for T (t must hold T).
template <typename T>
CoreType<T>* core_data(const torch::Tensor& t) {
  return reinterpret_cast<CoreType<T>*>(t.data_ptr<T>());
}

}  // namespace pagoda::simd_kernels
