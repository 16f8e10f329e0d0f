"""What the calculator needs to know about a model and a GPU, and how to read a model's HF config.json.

No torch here: `pagoda calc` must start in a blink.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda import moe_config


@dataclass(frozen=True)
class GpuSpec:
    """Dense (never 2:4-sparse) peak figures for one device."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core TFLOP/s (measured fp32 for "this machine")
    bandwidth_tbps: float  # memory bandwidth, TB/s (10^12 bytes/s)
    memory_gb: float  # capacity, GB (10^9 bytes), as the datasheet prints it
    interconnect_gbps: float | None = None  # per-direction GPU-to-GPU GB/s, for TP all-reduces
    # One hop of a small-message ring all-reduce, in microseconds: the latency term of TP's all-reduces.
    interconnect_latency_us: float | None = None
    source: str = "datasheet"

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def interconnect_latency_s(self) -> float:
        return (self.interconnect_latency_us or 0.0) * 1e-6

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_tbps * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True)
class Architecture:
    """The shapes that KV-cache, attention and all-reduce figures need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Each layer's sliding window (None: full attention), as the engine reads the config; () when none slides.
    sliding_windows: tuple[int | None, ...] = ()

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of a mixture of experts: `top_k` of `num_experts` per token in each of
    `num_sparse_layers` layers, each expert `expert_params` weights (gate, up, down)."""

    num_experts: int
    top_k: int
    expert_params: float
    num_sparse_layers: int

    def routed_params(self, experts_per_layer: float) -> float:
        return experts_per_layer * self.expert_params * self.num_sparse_layers


@dataclass(frozen=True)
class ModelShape:
    """A decoder. `architecture` is None when only a parameter count was given; `experts` when it is dense."""

    name: str
    num_params: float
    # Weights that are multiplied for every token: all but an untied input embedding (a row lookup), and of a
    # mixture of experts' routed experts only the top k (its active parameters, less that embedding).
    matmul_params: float
    architecture: Architecture | None = None
    experts: ExpertShape | None = None

    def weights_read_params(self, batch: float) -> float:
        """Weights one decode step of `batch` tokens reads: every matmul weight once, and of routed experts
        the ones some token chose (`expected_experts_hit`, routing taken as uniform)."""
        if self.experts is None:
            return self.matmul_params
        experts = self.experts
        hit = expected_experts_hit(experts.num_experts, experts.top_k, batch)
        return self.matmul_params - experts.routed_params(experts.top_k) + experts.routed_params(hit)


def expected_experts_hit(num_experts: int, top_k: int, batch: float) -> float:
    """Distinct experts a layer runs for `batch` tokens that each pick `top_k` of `num_experts` uniformly:
    an expert is missed by one token with probability 1 - k/E, by all of them with its B-th power."""
    missed: float = (1 - top_k / num_experts) ** batch
    return num_experts * (1 - missed)


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_param_count(text: str) -> float | None:
    """'70B' -> 7e10, '124.6M' -> 1.246e8, '7e9' -> 7e9; None when the text is not a count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if match is None:
        return None
    return float(match.group(1)) * _SUFFIXES.get(match.group(2), 1.0)


def params_only(text: str, num_params: float) -> ModelShape:
    return ModelShape(
        name=f"{text} params (no architecture)", num_params=num_params, matmul_params=num_params
    )


def _require(config: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    raise ValueError(f"config.json lacks {' / '.join(keys)}; is this a decoder-only HF config?")


def shape_from_hf_config(config: dict[str, Any], name: str) -> ModelShape:
    """Count a Llama-family model's parameters from its config: embeddings, attention, gated MLP (or routed
    experts, router and shared expert), norms."""
    moe = _moe(config)
    vocab = _require(config, "vocab_size")
    hidden = _require(config, "hidden_size", "n_embd")
    layers = _require(config, "num_hidden_layers", "n_layer")
    heads = _require(config, "num_attention_heads", "n_head")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = _require(config, "intermediate_size")
    tied = bool(config.get("tie_word_embeddings", False))
    # Qwen2 puts biases on q/k/v without saying so in its config.
    qkv_bias = bool(config.get("attention_bias", config.get("qkv_bias", config.get("model_type") in _QKV_BIASED)))

    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    attention += (q_dim + 2 * kv_dim) if qkv_bias else 0
    mlp = 3 * hidden * intermediate  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # two RMSNorm weights
    per_layer += 2 * head_dim if config.get("model_type") in ("qwen3", "qwen3_moe") else 0  # q and k norms
    embedding = vocab * hidden
    lm_head = 0 if tied else vocab * hidden
    experts = None
    sparse_extra = 0.0  # what a sparse layer holds beyond a dense one
    if moe is not None:
        experts = ExpertShape(moe.num_experts, moe.top_k, 3 * hidden * moe.expert_intermediate_size,
                              moe.num_sparse_layers)
        shared = moe.shared_expert_intermediate_size
        router = moe.num_experts * hidden + (hidden if shared else 0)  # and the shared expert's one-row gate
        sparse_extra = moe.num_experts * experts.expert_params + router + 3 * hidden * shared - mlp
    num_sparse = 0 if moe is None else moe.num_sparse_layers
    total = embedding + layers * per_layer + num_sparse * sparse_extra + hidden + lm_head
    # A tied table is read as the LM head; an untied input embedding is only indexed.
    matmul = total - (0 if tied else embedding)
    if experts is not None:
        matmul -= experts.routed_params(experts.num_experts - experts.top_k)
    return ModelShape(
        name=name,
        num_params=float(total),
        matmul_params=float(matmul),
        architecture=Architecture(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                                  head_dim=head_dim, sliding_windows=sliding_windows(config, layers)),
        experts=experts,
    )


def sliding_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as pagoda's loader reads it (model/loader.py, model/families.py; a test holds
    them equal): `layer_types` where given, else Gemma's pattern (every 2nd layer global in Gemma 2, every 6th in
    Gemma 3), Qwen's `use_sliding_window` from `max_window_layers` up, every layer otherwise (Mistral, Phi-3)."""
    window = config.get("sliding_window")
    model_type = str(config.get("model_type"))
    if window is None or (model_type.startswith("qwen") and not config.get("use_sliding_window", False)):
        return ()
    layer_types = config.get("layer_types")
    if layer_types is None:
        if model_type.startswith("gemma"):
            pattern = config.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif model_type.startswith("qwen"):
            first = config.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention"] * num_layers
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


# Qwen2 (and Qwen2-MoE) put biases on q/k/v without an attention_bias field.
_QKV_BIASED = ("qwen2", "qwen2_moe")


def _moe(config: dict[str, Any]) -> moe_config.MoEConfig | None:
    """The config's routed experts (pagoda/moe_config.py, as the engine reads them), None for a dense model."""
    if (config.get("num_local_experts") or config.get("num_experts") or 0) <= 1:
        return None
    families = {name: name for name in moe_config.DENSE_FAMILY}
    arch = next((moe_config.MOE_ARCHITECTURES[a] for a in config.get("architectures") or ()
                 if a in moe_config.MOE_ARCHITECTURES), families.get(str(config.get("model_type"))))
    if arch is None:
        # Shared experts and routing differ per family; wrong figures are worse than none.
        raise ValueError(f"mixture-of-experts configs other than {sorted(moe_config.MOE_ARCHITECTURES)} are not "
                         "modelled; pass a parameter count (e.g. 47B)")
    return moe_config.read_moe_config(config, arch, _require(config, "num_hidden_layers", "n_layer"))


def shape_from_path(path: Path) -> ModelShape:
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:  # the message alone would not say which file
        raise ValueError(f"{config_path}: not JSON ({error})") from error
    # Multimodal wrappers keep the language model's config under text_config.
    config = config.get("text_config", config)
    name = path.name if path.is_dir() else path.parent.name or str(path)
    return shape_from_hf_config(config, name)
