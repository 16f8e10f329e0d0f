"""What the calculator needs to know about a model and a GPU, and how to read a model's HF config.json.

No torch here: `pagoda calc` must start in a blink.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder. `architecture` is None when only a parameter count was given."""

    name: str
    num_params: float
    # Weights that are multiplied for every token: all but an untied input embedding (a row lookup).
    matmul_params: float
    architecture: Architecture | None = None


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
    """Count a Llama-family model's parameters from its config: embeddings, attention, gated MLP, norms."""
    if (config.get("num_local_experts") or config.get("num_experts") or 0) > 1:
        # Expert counts, shared experts and routing differ per family; wrong figures are worse than none.
        raise ValueError("mixture-of-experts configs are not modelled; pass a parameter count (e.g. 47B)")
    vocab = _require(config, "vocab_size")
    hidden = _require(config, "hidden_size", "n_embd")
    layers = _require(config, "num_hidden_layers", "n_layer")
    heads = _require(config, "num_attention_heads", "n_head")
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = _require(config, "intermediate_size")
    tied = bool(config.get("tie_word_embeddings", False))
    # Qwen2 puts biases on q/k/v without saying so in its config.
    qkv_bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))

    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    attention += (q_dim + 2 * kv_dim) if qkv_bias else 0
    mlp = 3 * hidden * intermediate  # gate, up, down
    per_layer = attention + mlp + 2 * hidden  # two RMSNorm weights
    embedding = vocab * hidden
    lm_head = 0 if tied else vocab * hidden
    total = embedding + layers * per_layer + hidden + lm_head
    # A tied table is read as the LM head; an untied input embedding is only indexed.
    matmul = total - (0 if tied else embedding)
    return ModelShape(
        name=name,
        num_params=float(total),
        matmul_params=float(matmul),
        architecture=Architecture(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                                  head_dim=head_dim),
    )


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
