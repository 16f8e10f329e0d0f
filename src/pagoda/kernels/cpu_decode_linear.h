// A linear layer of the native decode stack (cpu_decode.cpp, cpu_decode_moe.h): its weights as Python hands them
// over, and its product by the same kernels the module path calls for a decode-sized input.
#pragma once

#include <optional>
#include <tuple>

#include "cpu_ops.h"

namespace decode_stack {

using OptionalTensor = std::optional<torch::Tensor>;
// A linear layer as Python hands it over: (weight, scale, bias). The weight is fp32/bf16 [N, K] (no scale), int8
// [N, K] with its per-channel scale [N], or int4 codes uint8 [N, K / 2] (pagoda's int4 layout) with their bf16
// (scale, offset) pairs, block-major [N / 32, K / group, 32, 2].
using LinearSpec = std::tuple<torch::Tensor, OptionalTensor, OptionalTensor>;

struct Linear {
  torch::Tensor weight;
  OptionalTensor scale, bias;

  explicit Linear(const LinearSpec& spec)
      : weight(std::get<0>(spec)), scale(std::get<1>(spec)), bias(std::get<2>(spec)) {}

  // x W^T, without the bias: as DenseLinear / Int8Linear / Int4Linear.forward take a decode-sized input.
  torch::Tensor product(const torch::Tensor& x) const {
    if (weight.scalar_type() == at::kByte) return matmul_int4(x, weight, weight.size(1) * 2 / scale->size(1), *scale);
    if (scale) return gemv_int8(x, weight, *scale);
    return weight.scalar_type() == at::kBFloat16 ? gemv_bf16(x, weight) : gemv_fp32(x, weight);
  }

  torch::Tensor with_bias(const torch::Tensor& y) const {
    return bias ? y + bias->to(y.scalar_type()) : y;  // int4 keeps an fp32 bias for every model dtype
  }

  // The whole linear, as the module's forward computes it for a decode-sized input.
  torch::Tensor operator()(const torch::Tensor& x) const { return with_bias(product(x)); }
};

inline std::optional<Linear> optional_linear(const std::optional<LinearSpec>& spec) {
  return spec ? std::optional<Linear>(Linear(*spec)) : std::nullopt;
}

// A SwiGLU MLP's output: gate_up, the SiLU gate in one call, down (GatedMLP.forward and
// GroupedExperts.forward_expert with the kernels).
inline torch::Tensor swiglu(const Linear& gate_up, const Linear& down, const torch::Tensor& x) {
  return down(silu_mul(gate_up(x)));
}

}  // namespace decode_stack
