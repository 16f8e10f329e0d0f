// A sparse layer's MLP in the native decode stack: model/moe.py's SparseMoeBlock.forward, step for step (the same
// routing kernel, the same order of the (token, expert) pairs, each chosen expert's SwiGLU through the GEMVs over
// its own rows, the weighted sum added expert by expert in ascending order, each multiply and add rounded to the
// model's dtype as torch rounds them), so its output is the module path's bit for bit. Only the chosen experts'
// weights are read: what makes a mixture of experts fast at batch 1. The steps between the GEMVs are plain loops
// over a handful of numbers: through torch's ops they cost more than the experts' weights take to stream.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_decode_linear.h"

namespace decode_stack {

// The router's choice for each row of x: (weights fp32 [rows, top_k], experts int64 [rows, top_k]), the experts
// by descending probability (the lower index first on a tie). The logits are x . router in fp32, rounded to the
// model's dtype as a linear's output is; their softmax in fp32; the top k, divided by their sum when
// `renormalise`. model/moe.py's TopKRouter calls it too, for every step it runs.
template <typename T>
void route_rows(const T* x, const T* router, int64_t rows, int64_t experts, int64_t hidden, int64_t top_k,
                bool renormalise, float* weights, int64_t* chosen) {
  constexpr int kLanes = 16;  // fixed partial sums: a vectorizable dot product with one order of additions
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> probability(experts);
    std::vector<bool> taken(experts);
    for (int64_t row = begin; row < end; ++row) {
      const T* in = x + row * hidden;
      float top = -INFINITY;
      for (int64_t e = 0; e < experts; ++e) {
        const T* w = router + e * hidden;
        float lanes[kLanes] = {};
        int64_t h = 0;
        for (; h + kLanes <= hidden; h += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<float>(in[h + l]) * static_cast<float>(w[h + l]);
        for (; h < hidden; ++h) lanes[h % kLanes] += static_cast<float>(in[h]) * static_cast<float>(w[h]);
        float dot = 0.0f;
        for (float lane : lanes) dot += lane;
        probability[e] = static_cast<float>(static_cast<T>(dot));
        top = std::max(top, probability[e]);
      }
      float total = 0.0f;
      for (float& p : probability) total += (p = std::exp(p - top));
      for (float& p : probability) p /= total;
      std::fill(taken.begin(), taken.end(), false);
      float* out_weights = weights + row * top_k;
      int64_t* out_experts = chosen + row * top_k;
      float kept = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e)
          if (!taken[e] && (best < 0 || probability[e] > probability[best])) best = e;
        taken[best] = true;
        out_experts[j] = best;
        out_weights[j] = probability[best];
        kept += probability[best];
      }
      if (renormalise)
        for (int64_t j = 0; j < top_k; ++j) out_weights[j] /= kept;
    }
  });
}

inline std::tuple<torch::Tensor, torch::Tensor> moe_route(const torch::Tensor& x, const torch::Tensor& router,
                                                          int64_t top_k, bool renormalise) {
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && x.size(1) == router.size(1) &&
                  x.scalar_type() == router.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_route takes x [rows, hidden] and the router [experts, hidden], both fp32 or both bf16");
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "top_k is 1 .. the number of experts");
  const torch::Tensor in = x.contiguous(), w = router.contiguous();
  const int64_t rows = in.size(0), experts = w.size(0), hidden = in.size(1);
  torch::Tensor weights = at::empty({rows, top_k}, in.options().dtype(at::kFloat));
  torch::Tensor chosen = at::empty({rows, top_k}, in.options().dtype(at::kLong));
  if (in.scalar_type() == at::kFloat)
    route_rows(in.data_ptr<float>(), w.data_ptr<float>(), rows, experts, hidden, top_k, renormalise,
               weights.data_ptr<float>(), chosen.data_ptr<int64_t>());
  else
    route_rows(in.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), rows, experts, hidden, top_k, renormalise,
               weights.data_ptr<float>(), chosen.data_ptr<int64_t>());
  return {weights, chosen};
}

// out[token] += result * weight, in the model's dtype, each product and sum rounded as torch's mul and index_add_
// round them (model/moe.py's combine).
template <typename T>
void add_weighted(T* out, const T* result, float weight, int64_t hidden) {
  const T scale = static_cast<T>(weight);
  for (int64_t h = 0; h < hidden; ++h) {
    const T scaled = static_cast<T>(static_cast<float>(result[h]) * static_cast<float>(scale));
    out[h] = static_cast<T>(static_cast<float>(out[h]) + static_cast<float>(scaled));
  }
}

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
                    routed_tokens.numel() == router.size(0) && routed_tokens.scalar_type() == at::kLong &&
                    routed_tokens.is_contiguous(),
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

  torch::Tensor forward(const torch::Tensor& x_in) const {
    const torch::Tensor x = x_in.contiguous();
    const int64_t rows = x.size(0), hidden = x.size(1), experts = router.size(0), pairs = rows * top_k;
    const auto [weights, chosen] = moe_route(x, router, top_k, renormalise);
    // sort_pairs: by expert, by token within an expert (a counting sort is the stable argsort's order)
    const int64_t* expert_of = chosen.data_ptr<int64_t>();
    const float* weight_of = weights.data_ptr<float>();
    std::vector<int64_t> count(experts, 0), start(experts + 1, 0), token(pairs);
    std::vector<float> pair_weight(pairs);
    for (int64_t p = 0; p < pairs; ++p) ++count[expert_of[p]];
    for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + count[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t slot = next[expert_of[p]]++;
      token[slot] = p / top_k;
      pair_weight[slot] = weight_of[p];
    }
    int64_t* routed = routed_tokens.data_ptr<int64_t>();
    for (int64_t e = 0; e < experts; ++e) routed[e] += count[e];
    // run_experts and combine: each chosen expert over its rows, added into their tokens in ascending expert order
    torch::Tensor out = at::zeros_like(x);
    const int64_t row_bytes = hidden * x.element_size();
    const auto* in = static_cast<const char*>(x.data_ptr());
    for (int64_t e = 0; e < experts; ++e) {
      if (count[e] == 0) continue;
      torch::Tensor gathered = at::empty({count[e], hidden}, x.options());
      auto* to = static_cast<char*>(gathered.data_ptr());
      for (int64_t i = 0; i < count[e]; ++i)
        std::memcpy(to + i * row_bytes, in + token[start[e] + i] * row_bytes, row_bytes);
      const torch::Tensor result = swiglu(gate_up[e], down[e], gathered).contiguous();
      for (int64_t i = 0; i < count[e]; ++i) {
        const int64_t row = token[start[e] + i];
        if (x.scalar_type() == at::kFloat)
          add_weighted(out.data_ptr<float>() + row * hidden, result.data_ptr<float>() + i * hidden,
                       pair_weight[start[e] + i], hidden);
        else
          add_weighted(out.data_ptr<at::BFloat16>() + row * hidden, result.data_ptr<at::BFloat16>() + i * hidden,
                       pair_weight[start[e] + i], hidden);
      }
    }
    if (shared) {  // SparseMoeBlock.add_shared_expert
      const auto& [shared_gate_up, shared_down, gate] = *shared;
      out += at::sigmoid(at::linear(x, gate)) * swiglu(shared_gate_up, shared_down, x);
    }
    return out;
  }
};

}  // namespace decode_stack
