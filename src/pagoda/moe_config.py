"""Mixture-of-experts settings, read from a Hugging Face config.json without torch.

One reader for the loader (model/loader.py) and the calculator (calc/shapes.py), so that both see the same
experts. Three families are read: Mixtral (every layer sparse, top-k weights renormalised), and Qwen2-MoE and
Qwen3-MoE (`norm_topk_prob` says whether to renormalise; a layer is sparse when it is not in
`mlp_only_layers` and (index + 1) is a multiple of `decoder_sparse_step`; Qwen2-MoE adds a shared expert
scaled by sigmoid(`shared_expert_gate`)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The HF architectures whose checkpoints hold routed experts, and their name in pagoda.
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# The dense family each one's attention, norms and windows follow.
DENSE_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of a model: `num_experts` SwiGLU experts of width `expert_intermediate_size` in each
    sparse layer, `top_k` of them per token, weighted by their softmax probabilities (renormalised over the
    top k when `norm_topk_prob`). `sparse_layers[i]`: whether layer i routes (else it has a dense MLP of the
    model's `intermediate_size`). A shared expert (width `shared_expert_intermediate_size`, 0: none) runs on
    every token of a sparse layer, scaled by sigmoid of a one-row gate."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


class MoEConfigError(ValueError):
    """A config.json field the MoE reader cannot take; the message names it."""


def read_moe_config(hf: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The experts of an HF config of pagoda architecture `arch`; None for a dense architecture."""
    if arch not in DENSE_FAMILY:
        return None

    def need(*names: str) -> Any:
        for name in names:
            if hf.get(name) is not None:
                return hf[name]
        raise MoEConfigError(f"required field {names[0]!r} is missing")

    num_experts = int(need("num_local_experts", "num_experts"))
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise MoEConfigError(f"field 'num_experts_per_tok' = {top_k} must be between 1 and the {num_experts} experts")
    if arch == "mixtral":
        return MoEConfig(num_experts, top_k, int(need("intermediate_size")), True, (True,) * num_layers)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_layers = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers))
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
    return MoEConfig(num_experts, top_k, int(need("moe_intermediate_size")), bool(hf.get("norm_topk_prob", False)),
                     sparse, shared)
