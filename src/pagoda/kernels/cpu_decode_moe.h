// A sparse layer's MLP in the native decode stack: model/moe.py's SparseMoeBlock.forward, op for op (the same
// routing, the same sort of the (token, expert) pairs, each chosen expert's SwiGLU through the GEMVs over its own
// rows, the weighted sum added expert by expert in ascending order), so its output is the module path's bit for
// bit. Only the chosen experts' weights are read: what makes a mixture of experts fast at batch 1.
#pragma once

#include <tuple>
#include <utility>
#include <vector>

#include "cpu_decode_linear.h"

namespace decode_stack {

struct RoutedExperts {
  torch::Tensor router;  // [num_experts, hidden], the model's dtype (RowGate: never quantized)
  int64_t top_k;
  bool renormalise;  // the k weights divided by their sum (norm_topk_prob; Mixtral's always)
  // The block's pairs routed per expert (int64 [num_experts]), added to in place: the load the metrics report.
  torch::Tensor routed_tokens;
  std::vector<Linear> gate_up, down;  // per expert
  // Qwen2-MoE's shared expert on every token, scaled by sigmoid(x . gate).
  std::optional<std::tuple<Linear, Linear, torch::Tensor>> shared;

  RoutedExperts(torch::Tensor router_weight, int64_t k, bool renormalise_k, torch::Tensor routed,
                const std::vector<LinearSpec>& gate_ups, const std::vector<LinearSpec>& downs,
                const std::optional<std::tuple<LinearSpec, LinearSpec, torch::Tensor>>& shared_expert)
      : router(std::move(router_weight)), top_k(k), renormalise(renormalise_k), routed_tokens(std::move(routed)) {
    TORCH_CHECK(router.size(0) == static_cast<int64_t>(gate_ups.size()) && gate_ups.size() == downs.size() &&
                    routed_tokens.numel() == router.size(0) && routed_tokens.scalar_type() == at::kLong,
                "one gate_up, one down and one routed-token count per expert the router scores");
    for (size_t e = 0; e < gate_ups.size(); ++e) {
      gate_up.emplace_back(gate_ups[e]);
      down.emplace_back(downs[e]);
    }
    if (shared_expert) {
      const auto& [shared_gate_up, shared_down, gate] = *shared_expert;
      shared.emplace(Linear(shared_gate_up), Linear(shared_down), gate);
    }
  }

  torch::Tensor forward(const torch::Tensor& x) const {
    // TopKRouter.route
    torch::Tensor probabilities = at::softmax(at::linear(x, router), -1, at::kFloat);
    auto [weights, experts] = at::topk(probabilities, top_k, -1);
    if (renormalise) weights.div_(weights.sum(-1, true));
    // sort_pairs: stable by expert, so by token within an expert
    torch::Tensor flat = experts.reshape(-1);
    torch::Tensor order = at::argsort(flat, /*stable=*/true);
    torch::Tensor tokens = at::div(order, top_k, "floor");
    torch::Tensor pair_weights = weights.reshape(-1).index_select(0, order);
    torch::Tensor counts = at::bincount(flat, std::nullopt, router.size(0));
    routed_tokens.add_(counts);
    // run_experts, then combine
    torch::Tensor rows = x.index_select(0, tokens);
    torch::Tensor out = at::zeros_like(x);
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t expert = 0, start = 0; expert < router.size(0); ++expert) {
      if (count[expert] == 0) continue;
      const int64_t end = start + count[expert];
      torch::Tensor result = swiglu(gate_up[expert], down[expert], rows.slice(0, start, end));
      torch::Tensor scaled = result * pair_weights.slice(0, start, end).unsqueeze(1).to(result.scalar_type());
      out.index_add_(0, tokens.slice(0, start, end), scaled);
      start = end;
    }
    if (shared) {  // SparseMoeBlock.add_shared_expert
      const auto& [shared_gate_up, shared_down, gate] = *shared;
      out += at::sigmoid(at::linear(x, gate)) * swiglu(shared_gate_up, shared_down, x);
    }
    return out;
  }
};

}  // namespace decode_stack
