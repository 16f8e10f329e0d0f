// The torch binding of simd_lora.h's LoRA deltas (every target's lora_add_, which the native decode stack calls
// too): checks, the rows' slots, and the work split across threads with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "cpu_ops.h"
#include "simd_lora.h"
#include "simd_tensors.h"

namespace {

namespace kernels = pagoda::simd_kernels;

constexpr int64_t kShrinkGrain = 1 << 15;  // multiply-adds of A a parallel task takes, at least
constexpr int64_t kExpandGrain = 1024;  // output columns a parallel task takes, at least

template <typename T>
void run_lora_add(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
                  const int64_t* slots, const float* scaling) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), rank = a.size(1);
  const auto* x_data = kernels::core_data<T>(x);
  const auto* a_data = kernels::core_data<T>(a);
  const auto* bt_data = kernels::core_data<T>(bt);
  auto* y_data = kernels::core_data<T>(y);
  const int64_t y_stride = y.stride(0);
  std::vector<float> t(M * rank);
  at::parallel_for(0, M, std::max<int64_t>(1, kShrinkGrain / (rank * K)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (slots[m] < 0) continue;
      kernels::lora_shrink(x_data + m * K, a_data + slots[m] * rank * K, K, rank, scaling[m], t.data() + m * rank);
    }
  });
  at::parallel_for(0, N, kExpandGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; ++m) {
      if (slots[m] < 0) continue;
      kernels::lora_expand(t.data() + m * rank, bt_data + slots[m] * rank * N, rank, N, y_data + m * y_stride,
                           begin, end);
    }
  });
}

}  // namespace

void lora_add_(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt,
               const torch::Tensor& row_slots, const torch::Tensor& row_scaling) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "x, y: 2-D; a, bt: 3-D");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous() && bt.is_contiguous() && y.stride(1) == 1,
              "x, a and bt must be contiguous, y's rows too");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(), "x, y, a and bt must share one dtype");
  TORCH_CHECK(a.size(0) == bt.size(0) && a.size(1) == bt.size(1), "a and bt disagree on slots or rank");
  TORCH_CHECK(a.size(2) == x.size(1) && bt.size(2) == y.size(1) && x.size(0) == y.size(0),
              "a [slots, rank, in], bt [slots, rank, out], x [rows, in], y [rows, out]");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_scaling.scalar_type() == at::kFloat &&
                  row_slots.is_contiguous() && row_scaling.is_contiguous() && row_slots.numel() == x.size(0) &&
                  row_scaling.numel() == x.size(0), "one int64 slot and one fp32 scaling a row");
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < x.size(0); ++m) TORCH_CHECK(slots[m] < a.size(0), "a row's slot is past the stack");
  const float* scaling = row_scaling.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    run_lora_add<float>(y, x, a, bt, slots, scaling);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add_ takes fp32 or bf16");
    run_lora_add<at::BFloat16>(y, x, a, bt, slots, scaling);
  }
}
