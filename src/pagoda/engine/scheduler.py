"""The one-budget scheduler: no prefill phase, no decode phase.

Each step hands out `max_num_batched_tokens`: running requests first (a decode costs one token, an
unfinished prefill its next chunk), then waiting requests in arrival order, whose prompts may be cut
into chunks. When blocks run out, the newest running request is preempted (its blocks freed, to be
recomputed later) and goes back to the front of the queue. Pure Python; no torch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.engine.kv_cache import KVCacheManager
from pagoda.engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last known token, so that the next one is sampled?"""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


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
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests (vLLM counts in tokens)
        self.prefix_cache_hits = 0  # of which served from the prefix cache

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
        budget = self._schedule_running(output, budget)
        # After a preemption the pool is tight: admitting new work would only thrash.
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

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

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances computed counts, appends sampled tokens, finishes requests that stop.

        Returns the requests that got a new token this step (finished ones included).
        """
        advanced = []
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            self.kv_cache.cache_full_blocks(request)
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.append_token(token_id)
            reason = request.check_stop()
            if reason is not None:
                self.finish(request, reason)
            advanced.append(request)
        return advanced

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
