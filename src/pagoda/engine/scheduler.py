"""The one-budget scheduler: no prefill phase, no decode phase.

Each step hands out `max_num_batched_tokens`: running requests first (a decode costs one token, an
unfinished prefill its next chunk), then waiting requests in arrival order, whose prompts may be cut
into chunks. When blocks run out, the newest running request is preempted (its blocks freed, to be
recomputed later) and goes back to the front of the queue. Speculative drafts come after the running
requests, from what is left of the budget and the free blocks: speculation never preempts anyone.
Pure Python; no torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.engine.kv_cache import KVCacheManager
from pagoda.engine.request import FinishReason, Request, RequestStatus
from pagoda.engine.speculative import DraftSource, SpecDecodeCounters, accept_drafts


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens; drafts included
    # Guessed tokens computed after the known ones (a decode only): the target samples at each of them too.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last known token, so that the next one is sampled?"""
        return self.request.num_computed_tokens + self.num_known_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_known_tokens == 1 and self.samples

    @property
    def num_samples(self) -> int:
        """Positions sampled this step: the one after the known tokens, and one after each draft."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        start = self.request.num_computed_tokens
        return self.request.all_token_ids[start : start + self.num_known_tokens] + self.draft_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, drafts: DraftSource | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.draft_source = drafts  # None: no speculative decoding
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests (vLLM counts in tokens)
        self.prefix_cache_hits = 0  # of which served from the prefix cache
        self.spec_decode = SpecDecodeCounters()

    def add_request(self, request: Request, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # --- schedule ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Drafts are asked for before anything moves: for the requests running as the step starts.
        drafts = {} if self.draft_source is None else self.draft_source.drafts(self.running)
        budget = self._schedule_running(output, budget)
        # After a preemption the pool is tight: admitting new work (or speculating) would only thrash.
        if not output.preempted:
            budget = self._schedule_drafts(output, budget, drafts)
            self._schedule_waiting(output, budget)
        return output

    def _schedule_drafts(self, output: SchedulerOutput, budget: int, drafts: Mapping[str, Sequence[int]]) -> int:
        """Adds drafts to the step's decodes from the budget and the free blocks the running requests left."""
        for item in output.scheduled:
            draft = list(drafts.get(item.request.request_id, ()))[:budget]
            if not draft or not item.is_decode:
                continue
            if self.kv_cache.allocate_slots(item.request, item.num_tokens + len(draft)) is None:
                continue  # no free block for the drafts: decode without them
            item.num_tokens += len(draft)
            item.draft_token_ids = draft
            budget -= len(draft)
        return budget

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_tokens) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(ScheduledRequest(request, num_tokens))
                budget -= num_tokens
                index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_tokens = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_tokens, hit_blocks) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- update ------------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[tuple[Request, int]]:
        """Advances computed counts, appends sampled tokens, finishes requests that stop.

        sampled: by request id, for each request that samples, the tokens sampled at each of its
        1 + len(drafts) positions (one token without drafts). Returns the
        requests that got new tokens this step (finished ones included), each with how many.
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            token_ids = sampled.get(request.request_id)
            if token_ids is None:  # a prefill chunk that did not reach the end of the prompt
                request.num_computed_tokens += item.num_tokens
                self.kv_cache.cache_full_blocks(request)
                continue
            kept = accept_drafts(item.draft_token_ids, token_ids)
            if item.draft_token_ids:
                self.spec_decode.record(len(item.draft_token_ids), len(kept) - 1)
            reason, num_new = self._append(request, kept)
            # Every token but the newest now has its KV (a kept draft's was computed this step, after only
            # kept tokens); a rejected draft's KV does not count, and blocks are cached only below this.
            request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache.cache_full_blocks(request)
            if reason is not None:
                self.finish(request, reason)
            elif item.draft_token_ids:
                self.kv_cache.rollback(request, request.num_tokens)
            advanced.append((request, num_new))
        return advanced

    @staticmethod
    def _append(request: Request, token_ids: list[int]) -> tuple[FinishReason | None, int]:
        """Appends tokens one by one until one ends the request: (why it ended or None, tokens appended)."""
        for count, token_id in enumerate(token_ids, 1):
            request.append_token(token_id)
            reason = request.check_stop()
            if reason is not None:
                return reason, count
        return None, len(token_ids)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (stop, length, abort), wherever it is, and frees its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)

    # --- metrics -----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
