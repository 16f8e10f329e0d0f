// A decode step's whole layer stack in one native call.
//
// At batch-1 decode a layer is 4 GEMVs and 5 small fused ops; driven from Python, each costs a module
// call and an op dispatch (10-20 us with the interpreter's state cold: every step streams the weights
// through L3 and flushes it), about 2-6 ms a step on bench-1b, during which the memory bus idles. Here
// the same operations (cpu_ops.h, the very functions the Python path calls, in the same order: the
// results are bit for bit those of the module path) run from C++, with the GIL released, so that the
// server's event loop runs beside the step instead of between its ops.
//
// It takes decode-only steps whose every linear is a GEMV (model/native_decode.py decides), over one KV cache
// group or several (each layer reads through its group's block tables); anything else runs through the
// modules. LoRA adapters' deltas run inside it through lora_add_, the kernel the modules call for decode-sized
// inputs (forward_lora), so a step with adapter rows is also the module path's bit for bit. A mixture of experts'
// sparse layers run in it too (cpu_decode_moe.h: the chosen experts' GEMVs only).
#include <c10/core/InferenceMode.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_decode_linear.h"
#include "cpu_decode_moe.h"

namespace {

using decode_stack::Linear;
using decode_stack::LinearSpec;
using decode_stack::OptionalTensor;
using decode_stack::RoutedExperts;
using decode_stack::optional_linear;
// A layer's KV cache as Python hands it over (model/kv_cache.py's LayerKV.kernel_args): k, v, and their scales
// (int8: per token and head; fp8: the layer's; None: the model's dtype).
using KVSpec = std::tuple<torch::Tensor, torch::Tensor, OptionalTensor, OptionalTensor>;

// One adapter module's share of a linear's output: columns [start, end) get each row's delta from its own slot
// (lora_add_). a: [slots, max_rank, in] and bt: [slots, max_rank, out] are views of model/lora.py's LoRAStack, so
// an adapter loaded into a slot is seen here without telling the stack.
struct LoRAPart {
  int64_t module;  // the PEFT module's id (model/lora.py numbers them); a step adds it only if it targets it
  int64_t start, end;
  torch::Tensor a, bt;
};

// A step's adapter rows: each row's slot (int64 [rows], -1: the base) and its adapter's scaling (fp32 [rows]);
// targeted[module]: an adapter of the step targets it.
struct LoRAStep {
  torch::Tensor row_slots, row_scaling;
  std::vector<bool> targeted;
};

enum LinearIndex : int64_t { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3 };

// Where a layer's norms sit (ModelConfig.norm_placement): before each sublayer (Llama's), after each sublayer's
// output, the sublayers reading the stream itself (OLMo 2's), or both (Gemma's sandwich).
enum class Placement { kPre, kPost, kSandwich };

// How a norm applies its weight, as model/layers.py's RMSNorm does for the family: the fused kernel (Llama's); or
// the weight times the fp32 normalized value before the cast back, which the fused kernel computes only in fp32
// (OLMo 2's, and Gemma's, whose (1 + weight) is handed over as that fp32 sum).
enum class NormScale { kFused, kInFp32 };

// torch's ops for a norm scaled in fp32 (RMSNorm.forward's fallback).
torch::Tensor norm_in_torch(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return (weight * at::rms_norm(x.to(at::kFloat), {weight.size(0)}, std::nullopt, eps)).to(x.scalar_type());
}

torch::Tensor norm(NormScale kind, torch::Tensor x, const OptionalTensor& delta, const torch::Tensor& weight,
                   double eps) {
  if (kind == NormScale::kFused || x.scalar_type() == at::kFloat) return add_rms_norm_(x, delta, weight, eps);
  if (delta) x.add_(*delta);
  return norm_in_torch(x, weight, eps);
}

// As RMSNorm.forward takes a slice of heads [tokens, heads, D] (Qwen3's and Gemma 3's q/k norms): the fused kernel
// where the slice is contiguous (one token) and the kernel is exact for the norm, torch's ops otherwise; written
// back into qkv, as the module path does.
void norm_heads_(NormScale kind, torch::Tensor heads, const torch::Tensor& weight, double eps) {
  torch::Tensor normed;
  if (heads.is_contiguous() && (kind == NormScale::kFused || heads.scalar_type() == at::kFloat))
    normed = add_rms_norm_(heads, std::nullopt, weight, eps);
  else if (kind == NormScale::kFused)
    normed = weight * at::rms_norm(heads.to(at::kFloat), {weight.size(0)}, std::nullopt, eps).to(heads.scalar_type());
  else
    normed = norm_in_torch(heads, weight, eps);
  heads.copy_(normed);
}

struct Layer {
  OptionalTensor input_norm;  // before attention: pre-norm and sandwich layers'
  torch::Tensor post_norm;  // after attention: the MLP's input norm (pre), or the attention output's
  OptionalTensor pre_ff_norm;  // sandwich layers': the MLP's input norm
  OptionalTensor post_ff_norm;  // post-norm and sandwich layers': the MLP output's
  OptionalTensor q_norm, k_norm;  // before rope: per head (Qwen3, Gemma 3), or across the projection (OLMo 2)
  Linear qkv, o;
  std::optional<Linear> gate_up, down;  // a dense MLP's; a sparse layer has `experts` instead
  int64_t window;  // 0: full attention
  int64_t rope;  // which of the step's rope tables it rotates with (Gemma 3's sliding layers have their own)
  std::vector<LoRAPart> lora[4];  // by LinearIndex
  std::optional<RoutedExperts> experts;  // a sparse layer's MLP

  const Linear& linear(LinearIndex index) const {
    switch (index) {
      case kQKV: return qkv;
      case kO: return o;
      case kGateUp: return *gate_up;
      default: return *down;
    }
  }

  // The linear's output with the step's adapter deltas added, as model/lora.py's LoRALinear computes it. A
  // row-parallel linear's partial sums are all-reduced (`reduce`) before its bias is added, as
  // model/parallel.py's QuantizedRowParallel does; the stack takes no adapter rows then (native_decode.py).
  torch::Tensor run(LinearIndex index, const torch::Tensor& x, const LoRAStep* step,
                    const std::optional<pybind11::function>& reduce) const {
    const Linear& linear = this->linear(index);
    torch::Tensor y = linear.product(x);
    if (reduce && (index == kO || index == kDown)) {
      TORCH_CHECK(step == nullptr, "a tensor-parallel stack takes no adapter rows");
      pybind11::gil_scoped_acquire gil;  // the collective is torch.distributed's, called from Python
      (*reduce)(y);
    }
    y = linear.with_bias(y);
    if (step == nullptr) return y;
    for (const LoRAPart& part : lora[index]) {
      if (part.module < static_cast<int64_t>(step->targeted.size()) && step->targeted[part.module]) {
        torch::Tensor columns = y.slice(1, part.start, part.end);
        lora_add_(columns, x, part.a, part.bt, step->row_slots, step->row_scaling);
      }
    }
    return y;
  }
};

// A step's attention inputs for one KV cache group (AttentionMetadata's): where each token's K/V goes, the
// decodes' key slots and their sequence lengths. Layers in different groups read through different block tables.
using GroupSpec = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using RopeSpec = std::tuple<torch::Tensor, torch::Tensor>;  // cos, sin

Placement parse_placement(const std::string& name) {
  if (name == "pre") return Placement::kPre;
  if (name == "post") return Placement::kPost;
  TORCH_CHECK(name == "sandwich", "norm placement is pre, post or sandwich, not ", name);
  return Placement::kSandwich;
}

class DecodeStack {
 public:
  // placement: ModelConfig.norm_placement. unit_offset: every norm's weight given is (1 + weight) in fp32 (Gemma).
  // gelu: the MLP's gate is GeGLU's tanh-approximated GELU, else SiLU. softcap: attention scores' cap (0: none).
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, double softcap,
              torch::Tensor final_norm, const std::string& placement, bool unit_offset, bool gelu)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale), softcap_(softcap),
        final_norm_(std::move(final_norm)), placement_(parse_placement(placement)),
        norm_scale_(unit_offset || placement_ == Placement::kPost ? NormScale::kInFp32 : NormScale::kFused),
        gelu_(gelu) {}

  void add_layer(OptionalTensor input_norm, torch::Tensor post_norm, OptionalTensor pre_ff_norm,
                 OptionalTensor post_ff_norm, OptionalTensor q_norm, OptionalTensor k_norm, const LinearSpec& qkv,
                 const LinearSpec& o, const std::optional<LinearSpec>& gate_up, const std::optional<LinearSpec>& down,
                 int64_t window, bool sliding_rope) {
    const bool pre = placement_ == Placement::kPre, post = placement_ == Placement::kPost;
    TORCH_CHECK(input_norm.has_value() != post && pre_ff_norm.has_value() == (placement_ == Placement::kSandwich) &&
                    post_ff_norm.has_value() != pre && q_norm.has_value() == k_norm.has_value() &&
                    (!post || q_norm),
                "a layer's norms are its placement's: an input norm unless post, a pre-MLP norm in a sandwich, an "
                "MLP output norm unless pre, q and k norms together (post: always)");
    TORCH_CHECK(gate_up.has_value() == down.has_value(), "a dense MLP has both gate_up and down, a sparse one neither");
    layers_.push_back({std::move(input_norm), std::move(post_norm), std::move(pre_ff_norm), std::move(post_ff_norm),
                       std::move(q_norm), std::move(k_norm), Linear(qkv), Linear(o), optional_linear(gate_up),
                       optional_linear(down), window, sliding_rope ? 1 : 0});
  }

  // Makes a layer added without an MLP a sparse one: model/moe.py's SparseMoeBlock (the rank's every expert).
  void set_experts(int64_t layer, torch::Tensor router, int64_t top_k, bool renormalise, torch::Tensor routed_tokens,
                   const std::vector<LinearSpec>& gate_ups, const std::vector<LinearSpec>& downs,
                   const std::optional<std::tuple<LinearSpec, LinearSpec, torch::Tensor>>& shared) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && !layers_[layer].gate_up,
                "set_experts takes a layer added without a dense MLP");
    layers_[layer].experts.emplace(std::move(router), top_k, renormalise, std::move(routed_tokens), gate_ups, downs,
                                   shared);
  }

  // Makes o and down row-parallel: `all_reduce(y)` sums their partial outputs across the ranks, in place, before
  // their bias (a tensor-parallel rank's stack; called with the GIL held).
  void set_all_reduce(pybind11::function all_reduce) { all_reduce_ = std::move(all_reduce); }

  // Adds (or, for the same layer, linear and module, replaces) an adapter module's part of a linear's output.
  void add_lora_part(int64_t layer, int64_t linear, int64_t module, int64_t start, int64_t end, torch::Tensor a,
                     torch::Tensor bt) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && linear >= 0 && linear < 4,
                "no such layer or linear");
    std::vector<LoRAPart>& parts = layers_[layer].lora[linear];
    for (LoRAPart& part : parts) {
      if (part.module == module) {
        part = {module, start, end, std::move(a), std::move(bt)};
        return;
      }
    }
    parts.push_back({module, start, end, std::move(a), std::move(bt)});
  }

  // x: the embedded tokens [B, hidden] (the residual stream, updated in place); ropes: the step's (cos, sin), and
  // the sliding layers' own where they have them; kv_caches: one (k, v, k_scale, v_scale) a layer; groups: each KV
  // cache group's attention inputs, layer_groups: each layer's group. Returns the final norm's output [B, hidden].
  torch::Tensor forward(torch::Tensor x, const std::vector<RopeSpec>& ropes, const std::vector<KVSpec>& kv_caches,
                        const std::vector<GroupSpec>& groups, const std::vector<int64_t>& layer_groups) const {
    return run(std::move(x), ropes, kv_caches, groups, layer_groups, nullptr);
  }

  // forward, with adapter rows: each row's slot and scaling (as LoRAStack.begin_step makes them) and the ids of
  // the modules its adapters target.
  torch::Tensor forward_lora(torch::Tensor x, const std::vector<RopeSpec>& ropes, const std::vector<KVSpec>& kv_caches,
                             const std::vector<GroupSpec>& groups, const std::vector<int64_t>& layer_groups,
                             torch::Tensor row_slots, torch::Tensor row_scaling,
                             const std::vector<int64_t>& targeted) const {
    LoRAStep step{std::move(row_slots), std::move(row_scaling), {}};
    for (int64_t module : targeted) {
      TORCH_CHECK(module >= 0, "a module id is not negative");
      if (module >= static_cast<int64_t>(step.targeted.size())) step.targeted.resize(module + 1, false);
      step.targeted[module] = true;
    }
    return run(std::move(x), ropes, kv_caches, groups, layer_groups, &step);
  }

 private:
  torch::Tensor norm_(torch::Tensor x, const OptionalTensor& delta, const torch::Tensor& weight) const {
    return norm(norm_scale_, std::move(x), delta, weight, eps_);
  }

  torch::Tensor mlp(const Layer& layer, const torch::Tensor& x, const LoRAStep* lora) const {
    if (layer.experts) {
      TORCH_CHECK(lora == nullptr && !all_reduce_, "a sparse layer takes no adapter rows and no tensor parallelism");
      return layer.experts->forward(x);
    }
    torch::Tensor gate_up = layer.run(kGateUp, x, lora, all_reduce_), gated;
    if (gelu_) {  // as GatedMLP.forward: torch's ops
      const std::vector<torch::Tensor> parts = gate_up.split(gate_up.size(1) / 2, 1);
      gated = at::gelu(parts[0], "tanh") * parts[1];
    } else {
      gated = silu_mul(gate_up);
    }
    return layer.run(kDown, gated, lora, all_reduce_);
  }

  torch::Tensor run(torch::Tensor x, const std::vector<RopeSpec>& ropes, const std::vector<KVSpec>& kv_caches,
                    const std::vector<GroupSpec>& groups, const std::vector<int64_t>& layer_groups,
                    const LoRAStep* lora) const {
    TORCH_CHECK(kv_caches.size() == layers_.size() && layer_groups.size() == layers_.size(),
                "one KV cache and one KV cache group per layer");
    c10::InferenceMode inference;
    OptionalTensor delta;
    const bool post = placement_ == Placement::kPost;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      TORCH_CHECK(layer.gate_up || layer.experts, "layer ", i, " has no MLP (set_experts)");
      auto [k_cache, v_cache, k_scale, v_scale] = kv_caches[i];
      const int64_t group = layer_groups[i];
      TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(groups.size()) &&
                  layer.rope < static_cast<int64_t>(ropes.size()), "no such KV cache group or rope table");
      const auto& [slot_mapping, key_slots, seq_lens] = groups[group];
      const auto& [cos, sin] = ropes[layer.rope];
      torch::Tensor qkv;
      if (post) {
        if (delta) x.add_(*delta);
        qkv = layer.run(kQKV, x, lora, all_reduce_);
        const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
        torch::Tensor q = qkv.slice(1, 0, q_size), k = qkv.slice(1, q_size, q_size + kv_size);
        q.copy_(norm_(q.contiguous(), std::nullopt, *layer.q_norm));
        k.copy_(norm_(k.contiguous(), std::nullopt, *layer.k_norm));
      } else {
        qkv = layer.run(kQKV, norm_(x, delta, *layer.input_norm), lora, all_reduce_);
      }
      qkv = qkv.view({-1, heads_ + 2 * kv_heads_, head_dim_});
      if (layer.q_norm && !post) {
        norm_heads_(norm_scale_, qkv.slice(1, 0, heads_), *layer.q_norm, eps_);
        norm_heads_(norm_scale_, qkv.slice(1, heads_, heads_ + kv_heads_), *layer.k_norm, eps_);
      }
      rotary_write_kv_(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads_, k_scale, v_scale);
      torch::Tensor attended = paged_decode_attention(qkv.slice(1, 0, heads_), k_cache, v_cache, key_slots,
                                                      seq_lens, layer.window, scale_, k_scale, v_scale,
                                                      softcap_);
      attended = layer.run(kO, attended.reshape({-1, heads_ * head_dim_}), lora, all_reduce_);
      switch (placement_) {
        case Placement::kPre:
          delta = mlp(layer, norm_(x, attended, layer.post_norm), lora);
          break;
        case Placement::kPost:
          x.add_(norm_(attended, std::nullopt, layer.post_norm));
          delta = norm_(mlp(layer, x, lora), std::nullopt, *layer.post_ff_norm);
          break;
        case Placement::kSandwich:
          delta = norm_(mlp(layer, norm_(x, norm_(attended, std::nullopt, layer.post_norm), *layer.pre_ff_norm),
                            lora), std::nullopt, *layer.post_ff_norm);
          break;
      }
    }
    return norm_(x, delta, final_norm_);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_, softcap_;  // RMSNorm's epsilon; attention's score scale and cap (0: none)
  torch::Tensor final_norm_;
  Placement placement_;
  NormScale norm_scale_;
  bool gelu_;
  std::vector<Layer> layers_;
  // Under tensor parallelism: sums a row-parallel linear's partial outputs across the ranks, in place.
  std::optional<pybind11::function> all_reduce_;
};

}  // namespace

void define_decode_stack(pybind11::module& m) {
  m.def("moe_route", &decode_stack::moe_route, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "x [rows, hidden], router [experts, hidden], top_k, renormalise -> (weights fp32, experts int64), each "
        "[rows, top_k]: a mixture of experts' routing (softmax of the logits, top k, renormalised if asked)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, double, torch::Tensor, const std::string&, bool,
                          bool>(),
           "heads, kv_heads, head_dim, eps, attention scale, attention softcap (0: none), final_norm, norm placement "
           "(pre, post or sandwich), "
           "unit_offset (norm weights given as 1 + weight, fp32), gelu (GeGLU, else SiLU)")
      .def("add_layer", &DecodeStack::add_layer,
           "input_norm, post_norm, pre_ff_norm, post_ff_norm (each None where the placement has none), q_norm and "
           "k_norm (or None), then qkv, o, gate_up, down as (weight, scale or None, bias or None), window, "
           "sliding_rope (rotate with the step's second rope table); gate_up and down None for a sparse layer, "
           "whose experts set_experts then gives")
      .def("set_experts", &DecodeStack::set_experts,
           "layer, router weight [E, hidden], top_k, renormalise, routed_tokens (int64 [E], added to in place), "
           "each expert's gate_up and down, then the shared expert's (gate_up, down, gate weight) or None")
      .def("set_all_reduce", &DecodeStack::set_all_reduce,
           "all_reduce(y): sums o's and down's partial outputs across tensor-parallel ranks, in place, before bias")
      .def("add_lora_part", &DecodeStack::add_lora_part,
           "layer, linear (0 qkv, 1 o, 2 gate_up, 3 down), module id, start, end, A [slots, rank, in], "
           "B transposed [slots, rank, out]")
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "x, ropes [(cos, sin)], kv_caches, groups [(slot_mapping, key_slots, seq_lens)], layer_groups "
           "-> final-normed hidden states")
      .def("forward_lora", &DecodeStack::forward_lora, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "forward's arguments, then the step's rows' LoRA slots and scalings and its targeted module ids");
}
