"""Request: one sequence being generated. Pure Python; no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.engine.api import RequestTimeline, TenantShare
from pagoda.engine.core.lora import AdapterId
from pagoda.kv_transfer_params import KVTransferParams
from pagoda.pooling import ResolvedPooling
from pagoda.sampling import SamplingParams
from pagoda.structured.interface import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


@dataclass
class Request:
    """One sample of one user request. `n > 1` makes n of these, told apart by `sample_index`.

    NOTE: `num_computed_tokens` counts tokens whose KV is in the cache. The request is "prefilling"
    while it is below `num_prompt_tokens`; after a preemption it drops to 0 and the prompt *and* the
    output so far are recomputed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # every request has one (drawn if the user gave none) so sampling survives recompute
    sample_index: int = 0
    group_id: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0
    cache_salt: str | None = None  # separates tenants in the prefix cache
    lora: AdapterId | None = None  # the LoRA adapter it runs with (None: the base model); keys its KV blocks too
    priority: int = 0  # under the "priority" policy, lower runs first (vLLM's convention)
    tenant: TenantShare | None = None  # whose it is: fair queuing among tenants (None: nobody's, weight 1)
    # Where the output stands in its constraint's grammar; advanced only by tokens appended to the output.
    grammar: GrammarMatcher | None = None
    # An embedding request (the pooling runner): prefill only, it ends once its prompt is computed, with the
    # pooled vector instead of tokens.
    pooling: ResolvedPooling | None = None

    output_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs[i]: logprobs of prompt token i + 1 (the first prompt token has none)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)  # its KV cache group 0's table
    # Every KV cache group's table (kv_groups.py), group 0's first; -1 where a sliding window dropped a block.
    block_tables: list[list[int]] = field(default_factory=list)
    # The request's timeline on time.monotonic()'s clock, recorded once, where each moment happens.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # What the KV connector answers for the next engine once the request finished (a prefill replica's
    # kv_transfer_params: where a decode replica pulls its prompt's KV from); None: nothing.
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Such requests compute their whole prompt: cached prompt tokens have no logits."""
        return self.params.prompt_logprobs is not None

    @property
    def num_blocks_held(self) -> int:
        """Pool blocks it holds over every KV cache group (not the -1 a window left in a table)."""
        return sum(1 for table in self.block_tables for block_id in table if block_id >= 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_output_tokens(self) -> int:
        """Output tokens allowed: max_tokens, capped by the room left in the context."""
        room = self.max_model_len - self.num_prompt_tokens
        if self.params.max_tokens is None:
            return room
        return min(self.params.max_tokens, room)

    def record_new_tokens(self, now: float) -> None:
        """Notes when the step that gave the request new output tokens ended."""
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(
            arrival=self.arrival_time, first_scheduled=self.first_scheduled_time,
            first_token=self.first_token_time, last_token=self.last_token_time,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=self.num_output_tokens,
        )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Why the last token ends the request (None if it does not); a stop token becomes the stop_reason.

        Stop strings are checked on the text, elsewhere.
        """
        num_output = self.num_output_tokens
        last = self.output_token_ids[-1]
        if num_output >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if num_output >= self.max_output_tokens:
            return FinishReason.LENGTH
        return None

