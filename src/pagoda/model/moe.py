"""The sparse MLP of a mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE; settings in pagoda/moe_config.py).

A router scores every expert per token; each token goes to its top k, weighted by their softmax probabilities
(renormalised over the k when the architecture says so). The layer runs the way CPU engines do it: the
step's (token, expert) pairs are sorted by expert, each expert's rows go through its SwiGLU as one matrix
multiplication (at batch 1, one GEMV per chosen expert: only the chosen experts' weights are read), and the
results are scaled by their routing weights and added back into their tokens' rows. Experts are added in
ascending expert order, as `transformers` adds them, so fp32 sums agree with it.

At load, each layer's experts are one grouped tensor per projection (`GroupedExperts`: gate and up fused,
[num_experts * 2 * width, hidden], and down, [num_experts * hidden, width]), filled expert by expert from
the checkpoint's per-expert tensors. `split` then gives each expert its own linear layers over views of that
storage, so that `quantization.prepare_linears` gives every expert the fast path its dtype and quantization
call for (int8 and int4 quantize per expert) exactly as it does a dense layer's linears. Under expert parallelism
(model/expert_parallel.py) a rank's grouped tensors hold its own experts only, and the pairs travel between ranks
between the sorting and the weighted sum; both halves are this module's (`sort_pairs`, `run_experts`, `combine`).

Each block counts the (token, expert) pairs it routed, per expert (`routed_tokens`: the load the metrics report).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.model.layers import GatedMLP

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels
    from pagoda.moe_config import MoEConfig

# A checkpoint's per-expert tensors: Mixtral's w1 (gate), w3 (up), w2 (down); Qwen's gate/up/down_proj.
_EXPERT_TENSOR = re.compile(
    r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_MIXTRAL_ROUTER = re.compile(r"layers\.(\d+)\.block_sparse_moe\.gate\.weight")
_SHARED_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.shared_expert\.(gate|up)_proj\.weight")
_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    return config.moe is not None and config.moe.sparse_layers[layer_index]


class RowGate(nn.Module):
    """A linear without bias that no quantization touches: routing decisions stay in the model's dtype."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TopKRouter(RowGate):
    def __init__(self, hidden_size: int, moe: MoEConfig, kernels: CpuKernels | None = None) -> None:
        """kernels: pagoda's CPU kernels, if the model runs them: the routing in one call (`moe_route`, which the
        native decode stack calls too, so that both route alike to the bit)."""
        super().__init__(hidden_size, moe.num_experts)
        self.top_k, self.renormalise = moe.top_k, moe.norm_topk_prob
        self.kernels = kernels

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [num_tokens, top_k]: the chosen experts and their fp32 routing weights."""
        if self.kernels is not None:
            return self.kernels.moe_route(x, self.weight, self.top_k, self.renormalise)
        probabilities = torch.softmax(self(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalise:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear whose weight is `weight` itself (a view: no copy)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


class GroupedExperts(nn.Module):
    """One layer's routed experts (all of them, or under expert parallelism the rank's own, numbered from 0 here):
    grouped tensors while loading, then (after `split`) one gate_up and one down linear per expert over them."""

    def __init__(self, hidden_size: int, width: int, num_experts: int, kernels: CpuKernels | None) -> None:
        super().__init__()
        self.hidden_size, self.width, self.num_experts = hidden_size, width, num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, width))
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()
        self.kernels = kernels  # pagoda's CPU kernels, if the model runs them: the SiLU gate in one call

    def split(self) -> None:
        """Once the grouped tensors are loaded: each expert's linears become views of its rows of them."""
        gate_up = self.gate_up_proj.detach().view(self.num_experts, 2 * self.width, self.hidden_size)
        down = self.down_proj.detach().view(self.num_experts, self.hidden_size, self.width)
        del self.gate_up_proj, self.down_proj  # the views below hold the storage
        for expert in range(self.num_experts):
            self.gate_up.append(_linear_over(gate_up[expert]))
            self.down.append(_linear_over(down[expert]))

    def forward_expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s SwiGLU over its rows (one matrix multiplication per projection)."""
        gate_up = self.gate_up[expert](rows)
        if self.kernels is not None:
            gated = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.width, dim=-1)
            gated = F.silu(gate) * up
        out: torch.Tensor = self.down[expert](gated)
        return out


@dataclass(frozen=True)
class RoutedPairs:
    """A step's (token, expert) pairs, sorted by expert (by token within an expert, as the sort is stable)."""

    tokens: torch.Tensor  # [pairs]: each pair's token row
    weights: torch.Tensor  # [pairs]: its fp32 routing weight
    counts: torch.Tensor  # [num_experts]: pairs per expert, int64


def sort_pairs(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> RoutedPairs:
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // experts.shape[1]
    return RoutedPairs(tokens, weights.reshape(-1)[order], torch.bincount(flat, minlength=num_experts))


def run_experts(experts: GroupedExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows for expert e, in order) through their experts: one call per expert
    with rows; an expert with none is not read."""
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            results[start:start + count] = experts.forward_expert(expert, rows[start:start + count])
            start += count
    return results


def combine(x: torch.Tensor, pairs: RoutedPairs, results: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each token's routed results scaled by their weights and summed, expert by expert in ascending order, as
    `transformers` adds them (so that fp32 sums agree with it)."""
    out = torch.zeros_like(x)
    start = 0
    for count in counts:
        if count:
            end = start + count
            scaled = results[start:end] * pairs.weights[start:end, None].to(results.dtype)
            out.index_add_(0, pairs.tokens[start:end], scaled)
            start = end
    return out


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: routed experts, plus Qwen2-MoE's gated shared expert where the model has one.
    experts_held: how many routed experts this block's grouped tensors hold (default: all of them)."""

    def __init__(self, config: ModelConfig, kernels: CpuKernels | None, experts_held: int | None = None) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.num_experts = moe.num_experts
        self.gate = TopKRouter(config.hidden_size, moe, kernels)
        self.experts = GroupedExperts(config.hidden_size, moe.expert_intermediate_size,
                                      experts_held or moe.num_experts, kernels)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: RowGate | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, moe.shared_expert_intermediate_size, False, kernels)
            self.shared_expert_gate = RowGate(config.hidden_size, 1)
        # Pairs routed to each expert since the model was built: made at the first step (not on the meta device).
        self.routed_tokens: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate.route(x)
        return self.add_shared_expert(x, self.dispatch(x, weights, experts))

    def add_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token: pairs sorted by expert, one call per expert hit."""
        pairs = sort_pairs(weights, experts, self.num_experts)
        self.count(pairs.counts)
        counts = pairs.counts.tolist()
        return combine(x, pairs, run_experts(self.experts, x.index_select(0, pairs.tokens), counts), counts)

    def count(self, counts: torch.Tensor) -> None:
        """Adds a step's pairs per expert (all the model's experts) to the block's load."""
        self.routed_counter().add_(counts)

    def routed_counter(self) -> torch.Tensor:
        """The block's pairs per expert (int64 [num_experts]), which each step adds to in place (the native decode
        stack's too). Made outside inference mode, so that steps inside it and calls outside it both add to it."""
        if self.routed_tokens is None:
            with torch.inference_mode(False):
                self.routed_tokens = torch.zeros(self.num_experts, dtype=torch.int64)
        return self.routed_tokens


def routed_token_counts(model: nn.Module) -> list[int] | None:
    """The (token, expert) pairs each expert has been routed, summed over the model's sparse layers; None for a
    dense model."""
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    if not blocks:
        return None
    total = torch.zeros(blocks[0].num_experts, dtype=torch.int64)
    for block in blocks:
        if block.routed_tokens is not None:
            total += block.routed_tokens
    return [int(count) for count in total.tolist()]


def split_grouped_experts(model: nn.Module) -> None:
    """After loading: every layer's grouped experts become per-expert linears (`GroupedExperts.split`)."""
    for module in list(model.modules()):
        if isinstance(module, GroupedExperts):
            module.split()


def moe_row_offsets(config: ModelConfig, held: range | None = None) -> dict[str, dict[str, int]]:
    """For each grouped parameter (by its full name): where each checkpoint tensor's rows start in it. held: the
    experts (the model's numbers) the grouped tensors hold, in order (default: all of them)."""
    moe = config.moe
    offsets: dict[str, dict[str, int]] = {}
    if moe is None:
        return offsets
    width, hidden = moe.expert_intermediate_size, config.hidden_size
    held = range(moe.num_experts) if held is None else held
    for layer in (i for i, sparse in enumerate(moe.sparse_layers) if sparse):
        prefix = f"layers.{layer}.mlp"
        gate_up: dict[str, int] = {}
        for index, expert in enumerate(held):
            gate_up |= {f"{expert}.gate": 2 * width * index, f"{expert}.up": 2 * width * index + width}
        offsets[f"{prefix}.experts.gate_up_proj"] = gate_up
        offsets[f"{prefix}.experts.down_proj"] = {str(expert): hidden * index for index, expert in enumerate(held)}
        if moe.shared_expert_intermediate_size:
            offsets[f"{prefix}.shared_expert.gate_up_proj.weight"] = {
                "gate": 0, "up": moe.shared_expert_intermediate_size}
    return offsets


def expert_target(name: str, row_offsets: dict[str, dict[str, int]]) -> tuple[str, int | None] | None:
    """Maps a checkpoint tensor of a sparse layer (its name without "model.") to (our parameter, row offset);
    None when the name is not one of them (it then names our parameter as it is, or is a dense tensor)."""
    if match := _EXPERT_TENSOR.fullmatch(name):
        layer, expert, projection = match.group(1), match.group(2), _PROJECTION[match.group(3)]
        if projection == "down":
            return _offset_into(name, f"layers.{layer}.mlp.experts.down_proj", expert, row_offsets)
        return _offset_into(name, f"layers.{layer}.mlp.experts.gate_up_proj", f"{expert}.{projection}", row_offsets)
    if match := _MIXTRAL_ROUTER.fullmatch(name):
        return f"layers.{match.group(1)}.mlp.gate.weight", None
    if match := _SHARED_EXPERT.fullmatch(name):
        param = f"layers.{match.group(1)}.mlp.shared_expert.gate_up_proj.weight"
        return _offset_into(name, param, match.group(2), row_offsets)
    return None


def _offset_into(name: str, param: str, part: str, row_offsets: dict[str, dict[str, int]]) -> tuple[str, int]:
    offset = row_offsets.get(param, {}).get(part)
    if offset is None:  # an expert of a layer the config calls dense, past its expert count, or not this rank's
        raise ValueError(f"unexpected tensor {name!r} in checkpoint (not an expert the config.json describes)")
    return param, offset
