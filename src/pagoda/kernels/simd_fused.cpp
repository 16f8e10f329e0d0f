// The torch binding of simd_fused.h's fused ops (the AVX2 module's add_rms_norm_, rotary_write_kv_ and
// silu_mul): checks, dtype dispatch, and rows split across threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <optional>

#include "cpu_kv_cache.h"
#include "cpu_ops.h"
#include "simd_fused.h"
#include "simd_tensors.h"

namespace {

namespace kernels = pagoda::simd_kernels;
using kernels::core_data;

// Rows per parallel task, so that a task has ~32K elements: decode-sized inputs run inline, with no
// thread wake-up (which costs more than the work).
int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, (int64_t{1} << 15) / row_elements); }

// Calls body(T{}) with T the C++ type of an fp32 or bf16 tensor.
template <typename Body>
void dispatch_float_types(at::ScalarType type, Body body) {
  if (type == at::kFloat) return body(float{});
  body(at::BFloat16{});
}

void check_float_types(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be fp32 or bf16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// x [rows, n] (updated in place to x + delta when delta is given); returns RMSNorm(x) * weight.
torch::Tensor add_rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& delta, const torch::Tensor& weight,
                            double eps) {
  check_float_types(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "weight: x's dtype, [n]");
  if (delta) {
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must match x");
    check_float_types(*delta, "delta");
  }
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  dispatch_float_types(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    auto* x_data = core_data<scalar_t>(x);
    const auto* delta_data = delta ? core_data<scalar_t>(*delta) : nullptr;
    const auto* weight_data = core_data<scalar_t>(weight);
    auto* out_data = core_data<scalar_t>(out);
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      kernels::add_rms_norm_rows(x_data, delta_data, weight_data, out_data, n, static_cast<float>(eps), begin, end);
    });
  });
  return out;
}

// qkv [tokens, H + 2 KVH, D]; cos, sin [tokens, ..., D] in qkv's dtype; caches [slots, KVH, D] in qkv's dtype,
// or quantized with their scales (cpu_kv_cache.h).
void rotary_write_kv_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                      torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t num_heads,
                      const std::optional<torch::Tensor>& k_scale, const std::optional<torch::Tensor>& v_scale) {
  const std::initializer_list<const torch::Tensor*> tensors = {&qkv, &cos, &sin};
  for (const auto* t : tensors) check_float_types(*t, "qkv, cos and sin");
  TORCH_CHECK(qkv.dim() == 3, "qkv [T,heads,D]");
  const pagoda::kv_quant::KVCacheView cache = pagoda::kv_cache_view(k_cache, v_cache, k_scale, v_scale, qkv.scalar_type());
  const int64_t tokens = qkv.size(0), KVH = k_cache.size(1), D = qkv.size(2);
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * KVH && k_cache.size(2) == D && D % 2 == 0, "qkv's heads and D");
  TORCH_CHECK(cos.numel() == tokens * D && sin.numel() == tokens * D, "one cos/sin row per token");
  for (const auto* t : tensors)
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "qkv, cos and sin must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == tokens && slot_mapping.is_contiguous(),
              "slot_mapping: int64 [tokens]");
  dispatch_float_types(qkv.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    auto* qkv_data = core_data<scalar_t>(qkv);
    const auto* cos_data = core_data<scalar_t>(cos);
    const auto* sin_data = core_data<scalar_t>(sin);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    at::parallel_for(0, tokens, grain_for((num_heads + 2 * KVH) * D), [&](int64_t begin, int64_t end) {
      kernels::rotary_write_kv_rows(qkv_data, cos_data, sin_data, cache, slots, num_heads, KVH, D, begin, end);
    });
  });
}

// gate_up [rows, 2 I] -> silu(gate) * up [rows, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_float_types(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dim must be even");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto* gate_up_data = core_data<scalar_t>(gate_up);
    auto* out_data = core_data<scalar_t>(out);
    at::parallel_for(0, rows, grain_for(2 * I), [&](int64_t begin, int64_t end) {
      kernels::silu_mul_rows(gate_up_data, out_data, I, begin, end);
    });
  });
  return out;
}
