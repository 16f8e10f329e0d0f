"""Frozen configuration objects. Everything the engine needs to know is decided here, once, at start-up.

The engine's defaults are written here and nowhere else: `LLM(...)` and the CLI take from these classes
every option they are not given (see entrypoints.build_engine_config).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GiB = 1 << 30

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(set(DTYPES))}") from None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, read from a Hugging Face config.json (see model/loader.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2, some Llamas)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k per head before rope (Qwen3)
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    # Per layer: None for full attention, else the window size in tokens (key kept iff q_pos - k_pos < w).
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _require_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # The pool is sized from bytes unless num_blocks is given (tests give explicit counts).
    kv_cache_memory_bytes: int = 2 * GiB
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive(self, "block_size")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        _require_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    quantization: str | None = None  # None or "int8" (weight-only, per output channel)
    use_kernels: bool = True  # pagoda's native CPU kernels where they apply (False: the torch reference)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
