"""The engine's outward API: every type the server, its metrics, the start-up summary and the router see.

Plain data and protocols only, no torch: a caller reads what the engine produced (request outputs, stats,
its description) and the errors it raises, never the engine's inside (its scheduler, KV manager or model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.kv_transfer_config import DEVICE_MEDIUM

# --- request outputs ---------------------------------------------------------------------------------


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(frozen=True)
class TenantShare:
    """Whose request it is, for fair queuing: the tenant's name and its weight (its share of the tokens the
    scheduler hands out when tenants compete; engine/core/queues.py)."""

    name: str
    weight: float = 1.0
    max_kv_blocks: int | None = None  # past this many KV blocks held, its requests are preempted first


@dataclass(frozen=True)
class RequestTimeline:
    """One sample's moments (monotonic seconds) and sizes: what vLLM's per-request histograms observe.

    queue: arrival to first scheduling; prefill: first scheduling to first token; decode: first token to
    last token; inference: first scheduling to last token; time per output token: decode / (outputs - 1).
    A moment that has not happened yet (or a request with one output token, for the last) gives None.
    """

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def queue_time(self) -> float | None:
        return _between(self.arrival, self.first_scheduled)

    @property
    def prefill_time(self) -> float | None:
        return _between(self.first_scheduled, self.first_token)

    @property
    def decode_time(self) -> float | None:
        return _between(self.first_token, self.last_token)

    @property
    def inference_time(self) -> float | None:
        return _between(self.first_scheduled, self.last_token)

    @property
    def time_per_output_token(self) -> float | None:
        decode = self.decode_time
        if decode is None or self.num_output_tokens < 2:
            return None
        return decode / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    timeline: RequestTimeline | None = None  # once the sample has finished: its moments, for metrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling
    # vLLM's shape: one entry per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A prefill replica's answer (vLLM's): where a decode replica pulls this prompt's KV from; None: nothing.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's shape): the pooled final hidden states, truncated and normalized as asked."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What an embedding request gives back (the pooling runner), once: when its prompt is all computed."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (last-token pooling only)
    timeline: RequestTimeline | None = None  # its moments, for metrics (its "last token": the prompt's end)


# What an engine step gives back: a generate request's progress, or an embedding request's vector.
EngineOutput = RequestOutput | EmbeddingRequestOutput


def best_logprobs(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k best (token id, logprob) pairs, best first; equal logprobs keep the dict's order."""
    return sorted(logprobs.items(), key=lambda item: -item[1])[:k]


# --- stats and description -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start-up, with vLLM's meanings: a draft is one request's guesses in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts the target agreed with (the target's own token not counted)
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts accepted at position i (0-based)


@dataclass(frozen=True)
class ExpertLoadStats:
    """A mixture of experts' load since start-up: the (token, expert) pairs routed to each expert, summed over the
    sparse layers, and to each expert-parallel rank (the sums over the experts it holds; one rank without expert
    parallelism). With pipeline stages, the first stage's sparse layers (the ones rank 0 runs)."""

    expert_tokens: tuple[int, ...]
    rank_tokens: tuple[int, ...]


@dataclass(frozen=True)
class LoRAStats:
    """The adapters of the running and waiting requests, by name (vLLM's vllm:lora_requests_info)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_lora: int  # max_loras: adapters one step may hold
    updated: float  # wall-clock time (time.time()) of the snapshot: the gauge's value, as vLLM sets it


@dataclass(frozen=True)
class KVTierStats:
    """One offload tier's counters since start-up (docs/kv-offload.md), named by the medium its KV events report."""

    medium: str
    hit_blocks: int = 0  # blocks loaded from it into the KV pool
    hit_tokens: int = 0
    bytes_loaded: int = 0
    bytes_saved: int = 0
    blocks_saved: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    failures: int = 0  # calls that failed or ran past the bounded wait: the store was bypassed
    refused_blocks: int = 0  # blocks found corrupt or of another layout: never served
    evicted_blocks: int = 0  # blocks it dropped (its LRU, a shared store's eviction, expiry or loss)


@dataclass(frozen=True)
class KVConnectorStats:
    """The KV connector's counters since start-up: vLLM's external prefix cache, in tokens, and each tier's."""

    external_prefix_cache_queries: int = 0  # prompt tokens looked up past the local prefix-cache hit
    external_prefix_cache_hits: int = 0  # of which loaded (not computed): failed loads are not counted
    failed_loads: int = 0  # requests whose load failed and which computed those tokens instead
    tiers: tuple[KVTierStats, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters, for metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use by requests
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up (vLLM counts in tokens)
    prefix_cache_hits: int = 0  # of which served from the prefix cache
    prompt_tokens_computed: int = 0  # prompt positions run through the model (recomputes after preemption too)
    kv_connector: KVConnectorStats | None = None  # None: no KV connector
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is not configured
    # vllm:iteration_tokens_total: steps by tokens computed (bucket upper bounds, counts with +Inf last, sum)
    iteration_token_buckets: tuple[int, ...] = ()
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    lora: LoRAStats | None = None  # None: LoRA adapters are off
    experts: ExpertLoadStats | None = None  # None: a dense model
    # the KV blocks each tenant's running requests hold (engine/core/queues.py's count, which its quota meets);
    # only tenants holding some
    kv_blocks_by_tenant: tuple[tuple[str, int], ...] = ()
    # the threads rank 0's steps run with now, and how often that count has changed (engine/thread_tuner.py)
    step_threads: int = 0
    step_thread_changes: int = 0


@dataclass(frozen=True)
class KVCacheDescription:
    """The KV pool as built: its size, why it has that size, and how its blocks are used."""

    num_blocks: int
    block_size: int
    num_bytes: int  # target's and draft's KV together
    sizing_reason: str  # why num_blocks (engine/kv_pool.py)
    enable_prefix_caching: bool
    dtype: str  # the KV's storage format: the model's dtype in vLLM's spelling ("float32", "bfloat16"), or "int8",
    # "fp8_e4m3" (--kv-cache-dtype; pagoda/kv_format.py)
    # With KV cache groups (a model with sliding windows; pagoda/kv_groups.py): what they are, e.g. "1 full + 1
    # sliding-window (4096) groups of 2 layers", and how many max_model_len sequences the pool holds at once.
    groups: str = ""
    max_len_sequences: int | None = None


@dataclass(frozen=True)
class EngineDescription:
    """What the engine is, once built: what the start-up summary and the metrics' info gauges report."""

    model: str  # the checkpoint's path
    num_parameters: int  # the checkpoint's, as stored (before fusing or quantizing)
    dtype: str  # the model's compute type, vLLM's spelling
    quantized_matmul: str | None  # what the model's quantized layers run (None: no quantized layer)
    max_model_len: int  # after the clamp to the model's context and the KV pool
    max_num_seqs: int
    num_threads: int  # the threads each step's tensor work runs on (on each rank)
    kv_cache: KVCacheDescription
    tensor_parallel_size: int = 1  # the processes each layer is split across
    pipeline_parallel_size: int = 1  # the stages the layers are split into (ranks: the product)
    runner: str = "generate"  # "pooling": an embedding model, which answers embedding requests only
    # The weights a dense model's decode step streams, as stored (scales included; the first rank's share): all
    # but the input embedding's table, which a step indexes. What `pagoda calc` predicts as weights read per step.
    weight_bytes_read_per_step: int = 0


# --- what the engine reports to -------------------------------------------------------------------------


class KVEventSink(Protocol):
    """Where the KV manager and the offload tiers report what they hold (KV events: vLLM's BlockStored,
    BlockRemoved, AllBlocksCleared; `medium` says which tier). Chosen at construction; the transport (ZMQ,
    msgpack) is the server's. Called on the engine thread and on the offload tiers' save thread, so an
    implementation only queues, under a lock."""

    def blocks_stored(self, block_hashes: Sequence[bytes], parent_hash: bytes | None, token_ids: Sequence[int],
                      block_size: int, medium: str = DEVICE_MEDIUM) -> None: ...

    def blocks_removed(self, block_hashes: Sequence[bytes], medium: str = DEVICE_MEDIUM) -> None: ...

    def all_blocks_cleared(self) -> None: ...


# --- errors ------------------------------------------------------------------------------------------------


class RequestRejected(ValueError):
    """The request can never run (too long for the context, bad token ids, ...): a 400, not a 500."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """The engine failed while handling this request. `alone`: the fault was this request's own (it failed
    and the others went on); else a failed step took every request in it. `by_constraint`: its output
    constraint broke while generating (a grammar that passed admission then hit one of the grammar engine's
    limits, or refused a token): the client's input is at fault, not the server (HTTP 400, not 500)."""

    def __init__(self, message: str, alone: bool = False, by_constraint: bool = False) -> None:
        super().__init__(message)
        self.alone = alone
        self.by_constraint = by_constraint


class EngineDeadError(RuntimeError):
    """The engine's loop has stopped: no request can run any more."""
