// The torch binding of simd_attention.h's paged decode attention (the AVX2 module's paged_decode_attention):
// checks, and the (sequence, kv head) tasks split across threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kv_cache.h"
#include "cpu_ops.h"
#include "simd_attention.h"
#include "simd_tensors.h"

namespace {

namespace kernels = pagoda::simd_kernels;

template <typename T>
void attend(const torch::Tensor& q, const pagoda::kv_quant::KVCacheView& cache, int64_t KVH, const torch::Tensor& slots,
            const torch::Tensor& seq_lens, torch::Tensor& out, int64_t window, float scale, float softcap) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), L = slots.size(1);
  const auto* q_data = kernels::core_data<T>(q);
  auto* out_data = kernels::core_data<T>(out);
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t* len_data = seq_lens.data_ptr<int64_t>();
  using Core = kernels::CoreType<T>;
  kernels::dispatch_kv_format<Core>(cache.format, [&](auto element) {
    using KV = decltype(element);
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      kernels::attend_tasks<Core, KV>(q_data, cache, slot_data, len_data, out_data, H, KVH, L, D, window, scale,
                                      softcap, begin, end);
    });
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& slots,
                                     const torch::Tensor& seq_lens, int64_t window, double scale,
                                     const std::optional<torch::Tensor>& k_scale,
                                     const std::optional<torch::Tensor>& v_scale, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q [B,H,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "fp32 or bf16 only");
  const auto cache = pagoda::kv_cache_view(k_cache, v_cache, k_scale, v_scale, q.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 slots and lens");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= kernels::kMaxGroup, "query heads per kv head: a divisor, at most 16");
  TORCH_CHECK(D % 16 == 0 && D <= kernels::kMaxHeadDim && k_cache.size(2) == D, "head_dim must be 16..128, a multiple of 16");
  TORCH_CHECK(slots.size(0) == B && seq_lens.size(0) == B, "one slot row and length per sequence");
  auto qc = q.contiguous();
  auto slot_rows = slots.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(qc);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(qc, cache, KVH, slot_rows, lens, out, window, static_cast<float>(scale),
                  static_cast<float>(softcap));
  } else {
    attend<at::BFloat16>(qc, cache, KVH, slot_rows, lens, out, window, static_cast<float>(scale),
                         static_cast<float>(softcap));
  }
  return out;
}
