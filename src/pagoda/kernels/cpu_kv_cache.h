// A layer's KV cache as Python hands it to the kernels (model/kv_cache.py's LayerKV.kernel_args: k, v and their
// scales), checked and turned into kv_quant.h's torch-free view. The codes' dtype says the format: the model's
// dtype (no scales), int8 (scales [slots, KVH] fp32) or float8_e4m3fn (one fp32 scale each).
#pragma once

#include <torch/extension.h>

#include <optional>

#include "kv_quant.h"

namespace pagoda {

inline kv_quant::KVCacheView kv_cache_view(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                           const std::optional<torch::Tensor>& k_scale,
                                           const std::optional<torch::Tensor>& v_scale, at::ScalarType model_dtype) {
  using kv_quant::KVFormat;
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "caches [S,KVH,D], K's and V's alike");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  kv_quant::KVCacheView view;
  view.k = k_cache.data_ptr();
  view.v = v_cache.data_ptr();
  const at::ScalarType type = k_cache.scalar_type();
  if (type == model_dtype) {
    TORCH_CHECK(!k_scale && !v_scale, "a cache in the model's dtype takes no scales");
    return view;
  }
  TORCH_CHECK(type == at::kChar || type == at::ScalarType::Float8_e4m3fn,
              "caches must be in the model's dtype, int8 or float8_e4m3fn");
  TORCH_CHECK(k_scale && v_scale, "quantized caches need their K and V scales");
  for (const torch::Tensor* scale : {&*k_scale, &*v_scale})
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous(), "scales must be contiguous fp32");
  if (type == at::kChar) {
    const std::vector<int64_t> shape = {k_cache.size(0), k_cache.size(1)};
    TORCH_CHECK(k_scale->sizes() == shape && v_scale->sizes() == shape, "int8 scales: [slots, kv_heads] each");
    view.format = KVFormat::kInt8;
    view.k_scales = k_scale->data_ptr<float>();
    view.v_scales = v_scale->data_ptr<float>();
    return view;
  }
  TORCH_CHECK(k_scale->numel() == 1 && v_scale->numel() == 1, "fp8 scales: one per layer each");
  view.format = KVFormat::kFp8;
  view.k_scale = *k_scale->data_ptr<float>();
  view.v_scale = *v_scale->data_ptr<float>();
  return view;
}

}  // namespace pagoda
