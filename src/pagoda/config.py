"""Frozen configuration objects. Everything the engine needs to know is decided here, once, at start-up.

The engine's defaults are written here and nowhere else: `LLM(...)` and the CLI take from these classes
every option they are not given (see entrypoints.build_engine_config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pagoda.dtypes import DTYPE_BYTES as DTYPE_BYTES  # re-exported: the dtypes moved, their importers did not
from pagoda.dtypes import dtype_name as dtype_name
from pagoda.int4_format import Int4Options
from pagoda.kv_format import is_quantized, kv_bytes_per_head, kv_cache_dtype_name
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.moe_config import MoEConfig
from pagoda.parallel_config import CPU_THREADS_BIND as CPU_THREADS_BIND  # re-exported
from pagoda.parallel_config import DISTRIBUTED_EXECUTOR_BACKENDS as DISTRIBUTED_EXECUTOR_BACKENDS  # re-exported
from pagoda.parallel_config import ParallelConfig as ParallelConfig  # re-exported: its home is parallel_config
from pagoda.structured.limits import GrammarLimits

GiB = 1 << 30

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
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear" | "yarn" | ..., ...}
    # Per layer: None for full attention, else the window size in tokens (key kept iff q_pos - k_pos < w).
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    moe: MoEConfig | None = None  # routed experts (pagoda/moe_config.py); None: every layer's MLP is dense
    # Beyond Llama's layout (model/families.py reads them; docs/models.md says what each does):
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (GeGLU)
    norm_placement: str = "pre"  # "pre" (Llama), "sandwich" (Gemma: before and after each sublayer), "post" (OLMo 2)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32 (Gemma)
    qk_norm_per_head: bool = True  # with qk_norm: per head, or over the whole q and k projections (OLMo 2)
    embedding_multiplier: float | None = None  # embeddings times it, in the model's dtype (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # q·k's scale if not head_dim**-0.5 (Gemma: query_pre_attn_scalar**-0.5)
    attn_logit_softcapping: float | None = None  # cap · tanh(score / cap) before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None  # (theta, scaling) of sliding layers (Gemma 3)
    rotary_dim: int | None = None  # rope over the first rotary_dim dims of each head only (partial rotary)

    def kv_bytes_per_token(self, dtype: object, cache_dtype: str = "auto") -> int:
        """dtype: the model's, as `dtype_name` takes it; cache_dtype: the KV format (`kv_format`), scales
        included."""
        per_head = kv_bytes_per_head(self.head_dim, cache_dtype, DTYPE_BYTES[dtype_name(dtype)])
        return int(2 * self.num_layers * self.num_kv_heads * per_head)


def _require_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Unless num_blocks is given (tests give explicit counts), the pool holds max_num_seqs x max_model_len
    # tokens, at most this many bytes (engine/kv_pool.py).
    kv_cache_memory_bytes: int = 2 * GiB
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # The KV's storage format (pagoda/kv_format.py): "auto" (the model's dtype), "fp8_e4m3" ("fp8" is taken as
    # it) or "int8". calculate_kv_scales: fp8's per-layer scales from the first K/V written, not 1.0.
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        _require_positive(self, "block_size")
        # Frozen: the normalised name is written once, here, so that equal settings compare equal.
        object.__setattr__(self, "cache_dtype", kv_cache_dtype_name(self.cache_dtype))
        if self.calculate_kv_scales and self.cache_dtype != "fp8_e4m3":
            raise ValueError(f"calculate_kv_scales applies to kv_cache_dtype fp8 only, not {self.cache_dtype!r} "
                             "(int8 KV has a scale per token and head, computed as each token is written)")

    def kv_dtype(self, model_dtype: str) -> str:
        """The KV's element type as reported (vLLM's spelling): the model's dtype under "auto"."""
        return model_dtype if not is_quantized(self.cache_dtype) else self.cache_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    """How each step's token budget is handed out (docs/scheduling.md).

    max_step_ms: while any request decodes, prefill work in a step is capped so that the step's predicted
    time stays within this many milliseconds (a stalled step is every decoding stream's inter-token gap);
    0 turns the cap off. long_prefill_token_threshold: vLLM's cap on one request's prefill chunk per step
    (0: none). scheduling_policy: "fcfs" or "priority" (lower `priority` first, FCFS within a level).
    priority_aging_s: under "priority", each level of priority counts as this many seconds of later
    arrival, which bounds how long lower levels can be passed over; 0 is vLLM's strict order (no bound).
    batching: "continuous" (admit whenever a slot frees) or "static", for teaching only: a new batch is
    admitted only once every request of the previous one has finished (engine/core/batching.py).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_step_ms: float = 200.0
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    priority_aging_s: float = 10.0
    batching: str = "continuous"

    def __post_init__(self) -> None:
        _require_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in ("max_step_ms", "long_prefill_token_threshold", "priority_aging_s"):
            if not getattr(self, name) >= 0:  # written so that nan fails too
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")


SCHEDULING_POLICIES = ("fcfs", "priority")
BATCHING_MODES = ("continuous", "static")  # static: teaching only (pagoda lab static-batching)


# The speculative decoding methods built; vLLM's others ("eagle", "medusa", ...) are refused by name.
SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")
# vLLM's default n-gram length when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5
# Keys that belong to one method only: given with another, they are refused by name.
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_STRING_KEYS = ("model", "quantization", "dtype")
_DRAFT_MODEL_KEYS = (*_STRING_KEYS, "first_token_candidates")
# "suffix" only, with vLLM's defaults (the tree depth is also its default num_speculative_tokens).
SUFFIX_DEFAULTS: dict[str, int | float] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
_FLOAT_KEYS = ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")


@dataclass(frozen=True)
class SuffixOptions:
    """SpeculativeConfig's suffix_decoding_* settings, in SUFFIX_DEFAULTS' order."""

    max_tree_depth: int
    max_cached_requests: int
    max_spec_factor: float
    min_token_prob: float


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `speculative_config` names (docs/speculative.md). Speculation
    never changes the output: it only lets one step produce several of the tokens decoding would give
    (a model draft keeps the output distribution of sampled requests; see docs/speculative.md).

    prompt_lookup_min/max ("ngram" only): the n-gram lengths tried, longest first. As in vLLM, when only
    one is given the other takes its value, and when neither is, both are 5.
    model, quantization, dtype ("draft_model" only): the draft checkpoint, which must share the target's
    vocabulary, its own weight quantization (None: unquantized) and its dtype (None: the target's).
    first_token_candidates ("draft_model" only, a pagoda extension): a request's first draft position
    is checked with this many of the draft's likeliest tokens (None: 1, the draft's own choice alone).
    disable_by_batch_size: no drafts in a step that starts with more running requests than this.
    suffix_decoding_* ("suffix" only; engine/core/suffix_decoding.py): the indexes' depth (which bounds match and
    draft together), how many requests' outputs the global index holds (0: none, each request's own only), the
    draft's length at most this factor times the matched length, and the least estimated probability of a
    drafted token. Absent, they take SUFFIX_DEFAULTS (vLLM's).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    first_token_candidates: int | None = None
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None

    def __post_init__(self) -> None:
        _check_speculative_method(self.method)
        _require_positive(self, "num_speculative_tokens")
        if self.method != "suffix":
            _refuse_keys(self, tuple(SUFFIX_DEFAULTS))
        if self.method == "ngram":
            self._resolve_lookup()
        elif self.method == "suffix":
            self._resolve_suffix()
        else:
            self._check_draft_model()
        if self.disable_by_batch_size is not None:
            _require_positive(self, "disable_by_batch_size")

    def _resolve_lookup(self) -> None:
        _refuse_keys(self, _DRAFT_MODEL_KEYS)
        given_min, given_max = self.prompt_lookup_min, self.prompt_lookup_max
        low = given_min if given_min is not None else given_max if given_max is not None else DEFAULT_PROMPT_LOOKUP
        high = given_max if given_max is not None else low
        # Frozen: the resolved lengths are written once, here, so that equal settings compare equal.
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        _require_positive(self, "prompt_lookup_min")
        if high < low:
            raise ValueError(f"prompt_lookup_max ({high}) must be at least prompt_lookup_min ({low})")

    def _resolve_suffix(self) -> None:
        _refuse_keys(self, (*_NGRAM_KEYS, *_DRAFT_MODEL_KEYS))
        for name, default in SUFFIX_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        options = self.suffix_options()
        if options.max_tree_depth < 2:
            raise ValueError("suffix_decoding_max_tree_depth must be at least 2 (a match and a drafted token)")
        if options.max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be at least 0 (0: no global index)")
        if not options.max_spec_factor > 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0 <= options.min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    def suffix_options(self) -> SuffixOptions:
        """The suffix_decoding_* settings, resolved ("suffix" only)."""
        values = [getattr(self, name) for name in SUFFIX_DEFAULTS]
        if self.method != "suffix" or None in values:
            raise ValueError(f"method {self.method!r} has no suffix decoding options")
        return SuffixOptions(*values)

    def _check_draft_model(self) -> None:
        _refuse_keys(self, _NGRAM_KEYS)
        if not self.model:
            raise ValueError('speculative_config: method "draft_model" needs "model", the draft checkpoint\'s path')
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(
                f"speculative_config: quantization must be \"int8\", \"int4\" or absent, got {self.quantization!r}"
            )
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.first_token_candidates is not None:
            _require_positive(self, "first_token_candidates")

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's JSON object. Keys pagoda does not take are refused by name, never ignored."""
        method = options.get("method")
        if not isinstance(method, str):
            hint = '; a draft model needs "method": "draft_model"' if "model" in options else ""
            raise ValueError(f"speculative_config needs a method, one of: {', '.join(SPECULATIVE_METHODS)}{hint}")
        _check_speculative_method(method)  # before the keys: another method's keys are not the problem
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key(s) {', '.join(unknown)}; pagoda takes {', '.join(names)}"
            )
        options = dict(options)
        if method == "suffix" and options.get("num_speculative_tokens") is None:  # vLLM's default: the depth
            depth = options.get("suffix_decoding_max_tree_depth")
            options["num_speculative_tokens"] = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"] if depth is None \
                else depth
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens")
        for name in names[1:]:
            value = options.get(name)
            if value is None:
                continue
            if name in _STRING_KEYS:
                if not isinstance(value, str):
                    raise ValueError(f"speculative_config: {name} must be a string, got {value!r}")
            elif name in _FLOAT_KEYS:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"speculative_config: {name} must be a number, got {value!r}")
                options[name] = float(value)
            elif isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config: {name} must be an integer, got {value!r}")
        return cls(**options)


def _refuse_keys(config: SpeculativeConfig, names: tuple[str, ...]) -> None:
    given = [name for name in names if getattr(config, name) is not None]
    if given:
        raise ValueError(f"speculative_config: {', '.join(given)} cannot be used with method {config.method!r}")


def _check_speculative_method(method: str) -> None:
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative decoding method {method!r} is not supported yet; supported: {', '.join(SPECULATIVE_METHODS)}"
        )


def speculative_config_from(value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """`speculative_config` as LLM(...) and the CLI take it: a vLLM-shaped dict, a SpeculativeConfig or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    return SpeculativeConfig.from_dict(value)


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (docs/lora.md), with vLLM's names; present only with enable_lora.

    max_loras: distinct adapters one step may hold (each a slot of the stacked adapter weights); a request whose
    adapter would pass it waits. max_cpu_loras: adapters kept loaded in memory, least recently used dropped
    beyond (None: max_loras). max_lora_rank: the highest rank an adapter may have.
    """

    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _require_positive(self, "max_loras", "max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"  # a DTYPE_BYTES name: LLM(...) and the CLI pass what they are given through dtype_name
    device: str = "cpu"
    seed: int = 0
    quantization: str | None = None  # None, "int8" (per output channel) or "int4" (group-wise), weight-only
    use_kernels: bool = True  # pagoda's native CPU kernels where they apply (False: the torch reference)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    quantization_config: Int4Options | None = None  # int4's quantizer options (None: its defaults)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # what one output constraint may cost
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how the model is split across processes
    lora: LoRAConfig | None = None  # None: no LoRA adapters (enable_lora off)
    kv_transfer_config: KVTransferConfig | None = None  # the KV connector (offload tiers); None: none
    runner: str = "generate"  # "generate", or "pooling": an embedding model (pagoda/pooling.py, vLLM's --runner)

    def __post_init__(self) -> None:
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"EngineConfig.runner must be generate or pooling, got {self.runner!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.quantization_config is not None and self.quantization != "int4":
            raise ValueError("quantization_config applies to --quantization int4 only")
