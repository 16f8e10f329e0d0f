"""The one-budget scheduler: no prefill phase, no decode phase.

Each step hands out `max_num_batched_tokens`: running requests first (a decode costs one token, an
unfinished prefill its next chunk), then waiting requests in the queue's order (queues.py: the policy's,
fair among tenants), whose prompts may be cut into chunks. When blocks run out, the last running request in
the policy's order (fcfs: the newest) is preempted (its blocks freed, recomputed later) and requeued. Drafts
come after the running requests, from the budget and free blocks left: speculation never preempts anyone.
While requests decode, the prefill tokens of a step are capped so that the step stays within its time
target (step_budget.py); the policy orders the running requests. Pure Python; no torch.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.engine.core.batching import make_admission_gate
from pagoda.engine.core.drafts import Draft, DraftSource
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.kv_connector import KVConnectorScheduler, StepItem
from pagoda.engine.core.lora import adapter_fits
from pagoda.engine.core.queues import make_waiting_queue
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.speculative import SpecDecodeCounters
from pagoda.engine.core.step_budget import LinearStepCost, PrefillAllowance, StepCostModel, prefill_token_cap
from pagoda.structured.interface import GrammarStateError

# vLLM's buckets for vllm:iteration_tokens_total (tokens computed per engine step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens; drafts included
    # Guessed tokens computed after the known ones (a decode only): the target samples at each of them too.
    draft_token_ids: list[int] = field(default_factory=list)
    # Other guesses at the first draft's position, computed after the drafts, each on a branch of its own.
    alternative_token_ids: list[int] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.draft_token_ids) - len(self.alternative_token_ids)

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last known token, so that the next one is sampled? (An
        embedding request never samples.)"""
        request = self.request
        return request.pooling is None and request.num_computed_tokens + self.num_known_tokens == request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_known_tokens == 1 and self.samples

    @property
    def num_samples(self) -> int:
        """Rows sampled this step: the one after the known tokens, and one after each draft and alternative."""
        return 1 + len(self.draft_token_ids) + len(self.alternative_token_ids) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        start = self.request.num_computed_tokens
        known = self.request.all_token_ids[start : start + self.num_known_tokens]
        return known + self.draft_token_ids + self.alternative_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    kv_connector_metadata: object | None = None  # the connector's work for this step (None: no connector)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class EngineCoreOutput:
    """What one request got from a step (vLLM's name): the tokens appended, ending at the one that finished
    it, with their logprobs when asked; or, with `error`, why the step failed it (nothing was appended)."""

    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] | None = None
    error: Exception | None = None
    pooled: list[float] | None = None  # an embedding request's vector, when its prompt is all computed


@dataclass
class StepTokenHistogram:
    """Cumulative counts of steps by tokens computed, in `bounds` buckets (Prometheus's `le`, plus +Inf)."""

    bounds: tuple[int, ...] = ITERATION_TOKENS_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    total: int = 0  # tokens over all steps (the histogram's sum)

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, num_tokens)] += 1
        self.total += num_tokens


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, drafts: DraftSource | None = None,
        step_cost: StepCostModel | None = None, max_loras: int | None = None,
        connector: KVConnectorScheduler | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """max_loras: the most LoRA adapters the running requests may hold together (None: adapters are off);
        clock: the time a request's scheduled and token moments are read from (a simulation's own)."""
        self.config = config
        self.clock = clock
        self.max_loras = max_loras
        self.connector = connector  # None: no external KV store
        self.kv_cache = kv_cache
        self.draft_source = drafts  # None: no speculative decoding
        self.step_cost: StepCostModel = step_cost if step_cost is not None else LinearStepCost()
        self.waiting = make_waiting_queue(config)
        self.admission = make_admission_gate(config)  # continuous, or static batching (teaching only)
        self.running: list[Request] = []
        self.iteration_tokens = StepTokenHistogram()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of admitted requests (vLLM counts in tokens)
        self.prefix_cache_hits = 0  # of which served from the prefix cache
        self.spec_decode = SpecDecodeCounters()
        self.prompt_tokens_computed = 0  # prompt positions the model ran (a recompute counts again)
        self.external_prefix_cache_queries = 0  # prompt tokens asked of the connector (past the local hit)
        self.external_prefix_cache_hits = 0  # of which loaded (a failed load's tokens taken back)
        self.failed_loads = 0

    def add_request(self, request: Request, front: bool = False) -> None:
        self.waiting.push(request, front)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
    # --- schedule ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output, budget = SchedulerOutput(), self.config.max_num_batched_tokens
        self.waiting.order_running(self.running)  # a tenant over its KV quota: served last, preempted first
        # Drafts are asked for before anything moves: for the requests running as the step starts.
        drafts = {} if self.draft_source is None else self.draft_source.drafts(self.running)
        prefill = self._prefill_allowance(budget)
        budget = self._schedule_running(output, budget, prefill)
        # After a preemption the pool is tight: admitting new work (or speculating) would only thrash.
        if not output.preempted:
            budget = self._schedule_drafts(output, budget, drafts)
        self.waiting.charge((item.request, item.num_tokens) for item in output.scheduled)
        if not output.preempted and self.admission.admits(self.running):
            self._schedule_waiting(output, budget, prefill)  # charges each request as it admits it
        if output.scheduled:
            self.iteration_tokens.observe(output.num_batched_tokens)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(
                [StepItem(item.request, item.num_known_tokens) for item in output.scheduled])
        return output

    def _prefill_allowance(self, budget: int) -> PrefillAllowance:
        """While requests decode, prefill gets what keeps the step within max_step_ms; else the whole budget.
        Decodes are counted as the step starts (a preemption can only make the step cheaper)."""
        num_decodes = sum(1 for request in self.running if request.num_tokens - request.num_computed_tokens == 1)
        cap = prefill_token_cap(self.step_cost, num_decodes, self.config.max_step_ms / 1e3)
        total = budget - num_decodes if cap is None else min(cap, budget - num_decodes)
        per_request = self.config.long_prefill_token_threshold or budget
        return PrefillAllowance(left=max(total, 0), per_request=per_request)

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The wall time a scheduled step took, schedule to outputs: what the step-time target is about."""
        self.step_cost.observe(output.num_batched_tokens, seconds)

    def _schedule_drafts(self, output: SchedulerOutput, budget: int, drafts: Mapping[str, Draft]) -> int:
        """Adds drafts to the step's decodes from the budget and the free blocks the running requests left."""
        for item in output.scheduled:
            draft = drafts.get(item.request.request_id)
            if draft is None or not item.is_decode:
                continue
            tokens = draft.token_ids[:budget]
            alternatives = draft.alternatives[: budget - len(tokens)] if tokens else []
            num_guesses = len(tokens) + len(alternatives)
            if not tokens or self.kv_cache.allocate_slots(item.request, item.num_tokens + num_guesses) is None:
                continue  # no budget, or no free block for the drafts: decode without them
            item.num_tokens += num_guesses
            item.draft_token_ids, item.alternative_token_ids = tokens, alternatives
            budget -= num_guesses
        return budget

    def _schedule_running(self, output: SchedulerOutput, budget: int, prefill: PrefillAllowance) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            wanted = request.num_tokens - request.num_computed_tokens
            num_tokens = min(wanted, budget) if wanted == 1 else prefill.chunk(wanted, budget)
            if num_tokens == 0:  # a prefill with no allowance left this step: it keeps its place
                index += 1
                continue
            while self.kv_cache.allocate_slots(request, num_tokens) is None:
                victim = self.running.pop()  # last in the policy's order: fcfs the newest, priority the lowest
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(ScheduledRequest(request, num_tokens))
                budget -= num_tokens
                if wanted > 1:
                    prefill.left -= num_tokens
                index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, prefill: PrefillAllowance) -> None:
        while self.waiting and budget > 0 and prefill.left > 0:
            # A full batch: places are shared by weight (queues.py), a free one goes to the head of the queue.
            full = len(self.running) >= self.config.max_num_seqs
            claim = self.waiting.place_for(self.running) if full else (self.waiting.peek(), None)
            if claim is None:
                break
            request, victim = claim
            if not adapter_fits(request.lora, (r.lora for r in self.running), self.max_loras):
                break  # its adapter would pass max_loras: it waits for a running adapter to drain
            if victim is not None:
                budget += self._preempt_scheduled(victim, output)
            admitted = self._admit(request, output, budget, prefill)
            if admitted is None:
                break  # nobody overtakes the head of the queue
            num_tokens, preempted = admitted
            self.waiting.charge([(request, num_tokens)])  # before the next pick: fairness within the step too
            budget -= num_tokens
            prefill.left -= num_tokens
            if preempted or victim is not None:
                break  # the pool is tight, or a place was taken: admit no more this step

    def _admit(
        self, request: Request, output: SchedulerOutput, budget: int, prefill: PrefillAllowance
    ) -> tuple[int, bool] | None:
        """Gives the head of the queue its first chunk: (tokens scheduled, whether running requests were
        preempted for it), or None when there is no room. Under "priority" it may preempt running requests
        that rank after it, the lowest first, until its chunk fits."""
        preempted = False
        while True:
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_external = 0 if self.connector is None else self.connector.get_num_new_matched_tokens(
                request, num_hit_tokens)
            num_tokens = prefill.chunk(request.num_tokens - num_hit_tokens - num_external, budget)
            # The external tokens take blocks as computed ones would, but no step budget.
            if self.kv_cache.allocate_slots(request, num_external + num_tokens, hit_blocks) is not None:
                break
            if not self.running or not self.waiting.outranks(request, self.running[-1]):
                return None
            budget += self._preempt_scheduled(self.running[-1], output)
            preempted = True
        self.waiting.take(request)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit_tokens + num_external
            request.first_scheduled_time = self.clock()
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        request.num_computed_tokens = num_hit_tokens + num_external
        if self.connector is not None:
            self.external_prefix_cache_queries += request.num_tokens - num_hit_tokens
            self.external_prefix_cache_hits += num_external
            self.connector.update_state_after_alloc(request, request.block_ids, num_external)
        request.status = RequestStatus.RUNNING
        self.waiting.add_running(self.running, request)
        output.scheduled.append(ScheduledRequest(request, num_tokens))
        return num_tokens, preempted

    def _preempt_scheduled(self, victim: Request, output: SchedulerOutput) -> int:
        """Preempts a running request that this step may already have scheduled; returns the tokens freed."""
        self.running.remove(victim)
        freed = sum(item.num_tokens for item in output.scheduled if item.request is victim)
        output.scheduled = [item for item in output.scheduled if item.request is not victim]
        self._preempt(victim)
        output.preempted.append(victim)
        return freed

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)

    # --- update ------------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Counts what the step computed, appends each request's new tokens (the runner's accepted + bonus)
        up to the one that finishes it, rolls back the KV of rejected drafts and finishes requests that stop.

        Returns what each request that sampled (or failed) this step got, finished ones included.
        """
        outputs = []
        now = self.clock()
        for item in output.scheduled:
            request = item.request
            num_valid = runner_output.kv_load_failures.get(request.request_id)
            if num_valid is not None:  # its load failed, so it did not run: it computes those tokens next
                self._load_failed(request, num_valid)
                continue
            start = request.num_computed_tokens
            self.prompt_tokens_computed += max(min(start + item.num_known_tokens, request.num_prompt_tokens) - start, 0)
            error = runner_output.failures.get(request.request_id)
            if error is not None:
                outputs.append(EngineCoreOutput(request, error=error))
                continue
            token_ids = runner_output.sampled_token_ids.get(request.request_id)
            if token_ids is None:  # a prefill chunk that did not reach the end of the prompt, or an embedding's
                request.num_computed_tokens += item.num_tokens
                self.kv_cache.cache_full_blocks(request)
                pooled = runner_output.pooled.get(request.request_id)
                if pooled is not None:  # an embedding is done with its prompt: it ends, its blocks freed now
                    request.record_new_tokens(now)
                    self.finish_requests([request], FinishReason.STOP)
                    outputs.append(EngineCoreOutput(request, pooled=pooled))
                continue
            if item.draft_token_ids:
                self.spec_decode.record(len(item.draft_token_ids), len(token_ids) - 1)
            try:
                reason, num_new = self._append(request, token_ids)
            except Exception as error:  # its grammar broke: that request's fault alone
                outputs.append(EngineCoreOutput(request, error=error))
                continue
            request.record_new_tokens(now)
            # Every token but the newest now has its KV (a kept draft's was computed this step, after only
            # kept tokens); a rejected draft's KV does not count, and blocks are cached only below this.
            request.num_computed_tokens = request.num_tokens - 1
            self.kv_cache.cache_full_blocks(request)
            if reason is not None:
                self.finish_requests([request], reason)
            elif item.draft_token_ids:
                self.kv_cache.rollback(request, request.num_tokens)
            logprobs = runner_output.logprobs.get(request.request_id)
            new_logprobs = None if logprobs is None else logprobs[:num_new]
            outputs.append(EngineCoreOutput(request, list(token_ids[:num_new]), new_logprobs))
        return outputs

    def _load_failed(self, request: Request, num_valid_tokens: int) -> None:
        assert self.connector is not None
        self.external_prefix_cache_hits -= request.num_computed_tokens - num_valid_tokens
        self.failed_loads += 1
        request.num_computed_tokens = num_valid_tokens
        self.connector.load_failed(request, num_valid_tokens)
        self.kv_cache.cache_full_blocks(request)  # the blocks that did load are good prefix-cache blocks

    @staticmethod
    def _append(request: Request, token_ids: Sequence[int]) -> tuple[FinishReason | None, int]:
        """Appends tokens one by one until one ends the request: (why it ended or None, tokens appended).
        Each token that does not end the request by itself advances its grammar, whose end ends it too."""
        for count, token_id in enumerate(token_ids, 1):
            request.append_token(token_id)
            reason = request.check_stop()
            if reason is None and request.grammar is not None:
                # The mask allowed the token: a refusal is the grammar engine's fault.
                if not request.grammar.accept_tokens([token_id]):
                    raise GrammarStateError(f"the grammar refused token {token_id} that its own mask allowed")
                if request.grammar.is_terminated():
                    reason = FinishReason.STOP
            if reason is not None:
                return reason, count
        return None, len(token_ids)

    def finish_requests(self, requests: Iterable[Request], reason: FinishReason) -> None:
        """Ends requests (stop, length, abort) wherever they are, and frees their blocks: the one way a
        request ends, by the scheduler's own stop checks or early, from outside (an abort, a stop string)."""
        for request in requests:
            if request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            num_held = 0 if self.connector is None else self.connector.request_finished(request)
            self.kv_cache.free(request, num_held)
            if self.draft_source is not None:
                self.draft_source.finished(request)
            self.requests.pop(request.request_id, None)

    # --- metrics -----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
