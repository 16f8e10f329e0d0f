"""LLMEngine: step() = schedule -> execute -> update."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace

import torch

from pagoda.config import EngineConfig, ModelConfig
from pagoda.engine.api import (
    EngineDescription,
    EngineStats,
    KVCacheDescription,
    KVEventSink,
    RequestOutput,
    RequestRejected,
    SpecDecodeStats,
)
from pagoda.engine.draft_model import DraftModelProposer, load_draft_model
from pagoda.engine.grammar_masks import StructuredOutputs
from pagoda.engine.kv_cache import KVCacheManager
from pagoda.engine.kv_pool import kv_pool_size
from pagoda.engine.output import IncrementalDetokenizer, SequenceText, Tokenizer
from pagoda.engine.request import FinishReason, Request
from pagoda.engine.runner import ModelRunner, PromptLogprobsChunk
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.speculative import Speculator
from pagoda.engine.step_budget import StepCostModel
from pagoda.model.llama import LlamaModel
from pagoda.model.loader import TORCH_DTYPES, load_model
from pagoda.model.quantization import quantized_matmul_name
from pagoda.sampling import SamplingParams
from pagoda.structured import InvalidConstraint
from pagoda.structured.interface import GrammarMatcher, GrammarStateError
from pagoda.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def _derive_seed(seed: int, sample_index: int) -> int:
    """Seeds for the n samples of one request: distinct, and reproducible from the user's seed."""
    return seed if sample_index == 0 else random.Random(seed * 1_000_003 + sample_index).getrandbits(63)


@dataclass
class RequestGroup:
    """All the engine holds for one user request, from add_request until it finishes, is aborted or fails."""

    request_id: str
    prompt: str | None  # as the user gave it, when that was text
    sequences: list[SequenceText]  # one per sample (`n`), in sample order; each holds its Request
    # n > 1 with prefix caching: the samples after the first wait here until the first has its first token,
    # by which time the prompt's blocks are cached for them to find instead of computing them again.
    deferred: list[Request] = field(default_factory=list)
    failure: Exception | None = None

    @property
    def requests(self) -> list[Request]:
        return [sequence.request for sequence in self.sequences]

    @property
    def finished(self) -> bool:
        return all(sequence.request.is_finished for sequence in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[sequence.completion() for sequence in self.sequences],
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            queue_time=_queue_time(first),
            prompt_logprobs=[None, *first.prompt_logprobs] if first.needs_prompt_logprobs else None,
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, step_cost: StepCostModel | None = None,
                 kv_events: KVEventSink | None = None) -> None:
        """step_cost: how the scheduler predicts a step's time (default: LinearStepCost, learnt online).
        kv_events: where the KV cache reports blocks stored and removed (default: nowhere)."""
        torch.manual_seed(config.seed)
        self.tokenizer: Tokenizer = load_tokenizer(config.model)
        model_max_len = config.scheduler.max_model_len
        model, model_config = load_model(
            config.model, dtype=TORCH_DTYPES[config.dtype], device=config.device, quantization=config.quantization,
            use_kernels=config.use_kernels, quantization_config=config.quantization_config,
        )
        self.model: LlamaModel = model
        self.model_config: ModelConfig = model_config
        speculative = config.speculative_config
        draft = self._load_draft_model(config)
        # A draft model's KV mirrors the target's slot for slot: the pool's bytes pay for both.
        bytes_per_token = self.model_config.kv_bytes_per_token(config.dtype) + (
            0 if draft is None else draft.config.kv_bytes_per_token(draft.dtype)
        )
        wanted_len = min(model_max_len, self.model_config.max_position_embeddings)
        self.kv_pool = kv_pool_size(config.cache, config.scheduler.max_num_seqs, wanted_len, bytes_per_token)
        num_blocks = self.kv_pool.num_blocks
        self.kv_pool_bytes = num_blocks * config.cache.block_size * bytes_per_token
        max_model_len = self._fit_max_model_len(wanted_len, num_blocks * config.cache.block_size)
        self.config = replace(config, scheduler=replace(config.scheduler, max_model_len=max_model_len))
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                       kv_events)
        self.eos_token_ids = self._eos_token_ids()
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                            config.grammar)
        self.draft_proposer = None if draft is None or speculative is None else DraftModelProposer(
            draft, speculative, num_blocks, config.cache.block_size, config.scheduler.max_num_seqs, max_model_len,
            self.structured, config.device,
        )
        self.speculator = None if speculative is None else Speculator(speculative, self.draft_proposer)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache, self.speculator, step_cost)
        self.runner = ModelRunner(
            self.model, num_blocks, config.cache.block_size, config.device, self.structured, self.draft_proposer
        )
        self._seed_source = random.Random(config.seed)
        self._groups: dict[str, RequestGroup] = {}  # by user request id; removed when finished or aborted
        self._failed: list[RequestGroup] = []  # failed (and aborted) since the last pop_failures()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB; %s), max_model_len %d",
            num_blocks, config.cache.block_size, self.kv_pool_bytes / 2**20, self.kv_pool.reason, max_model_len,
        )

    def _load_draft_model(self, config: EngineConfig) -> LlamaModel | None:
        """The speculative config's draft model, checked against the target (None: no draft model)."""
        speculative = config.speculative_config
        if speculative is None or speculative.method != "draft_model":
            return None
        draft, _ = load_draft_model(speculative, self.model_config, self.tokenizer, config.dtype, config.device,
                                    config.use_kernels)
        return draft

    def _fit_max_model_len(self, requested: int, pool_tokens: int) -> int:
        """One full-length sequence must fit in the pool, or preemption could livelock."""
        limit = min(requested, self.model_config.max_position_embeddings)
        if pool_tokens < limit:
            if pool_tokens < 16:
                raise ValueError(f"KV cache holds only {pool_tokens} tokens; give it more memory or blocks")
            logger.warning("max_model_len clamped from %d to %d: the KV pool holds %d tokens",
                           limit, pool_tokens, pool_tokens)
            limit = pool_tokens
        return limit

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # --- the vLLM-shaped API -----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids, prompt_text = self._tokenize(prompt)
        self.validate(prompt_ids, params, priority)
        constraint = params.structured_outputs
        grammar = None if constraint is None else self.structured.compile(constraint)  # cached by validate
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        sequences = []
        for index in range(params.n):
            request = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=prompt_ids,
                params=params,
                seed=_derive_seed(seed, index),
                sample_index=index,
                group_id=request_id,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                cache_salt=cache_salt,
                priority=priority,
                grammar=None if grammar is None else grammar.matcher(),
            )
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            sequences.append(SequenceText(request, detokenizer))
        group = RequestGroup(request_id, prompt_text, sequences)
        requests = group.requests
        if len(requests) > 1 and self.kv_cache.enable_prefix_caching:
            requests, group.deferred = requests[:1], requests[1:]
        self._groups[request_id] = group
        for request in requests:
            self.scheduler.add_request(request)

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        return list(prompt), None

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises RequestRejected for a request that can never run. Thread-safe: reads only config, and
        compiles the request's grammar (into a thread-safe cache) so that a bad constraint fails here."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if params.structured_outputs is not None:  # first: a constraint's fault is named whatever else is wrong
            try:
                self.structured.compile(params.structured_outputs)
            except InvalidConstraint as error:
                raise RequestRejected(str(error), error.param) from error
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            # vLLM's rule: a priority the scheduler would ignore is an error, not a silent no-op.
            raise RequestRejected(f"got priority {priority}, but priority scheduling is not enabled "
                                  "(--scheduling-policy priority)", "priority")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})")
        for param, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            for token_id in token_ids:
                if not 0 <= token_id < vocab_size:
                    raise RequestRejected(f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param)
        wanted = len(prompt_ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens or 1} for the completion)."
            )

    def abort_request(self, request_id: str | list[str]) -> None:
        for group_id in [request_id] if isinstance(request_id, str) else request_id:
            group = self._groups.pop(group_id, None)
            if group is not None:
                for request in group.requests:
                    self.scheduler.finish(request, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.runner.execute(scheduler_output)
        self._record_prompt_logprobs(runner_output.prompt_logprobs)
        advanced = self.scheduler.update(scheduler_output, runner_output.sampled)
        failed = {item.request.request_id: (item.request, runner_output.failures[item.request.request_id])
                  for item in scheduler_output.scheduled if item.request.request_id in runner_output.failures}
        outputs = self._make_outputs(advanced, runner_output.logprobs, failed)
        # The whole step, as a decoding stream waits for it, teaches the scheduler's step-time model.
        self.scheduler.observe_step(scheduler_output, time.perf_counter() - started)
        return outputs

    def _record_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        for request_id, (start, logprobs) in chunks.items():
            request = self.scheduler.requests[request_id]
            # After a preemption the prompt is recomputed: keep only positions not yet recorded.
            request.prompt_logprobs.extend(logprobs[len(request.prompt_logprobs) - start :])

    # --- state for metrics and maintenance ---------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage(),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            spec_decode=self._spec_decode_stats(),
            iteration_token_buckets=scheduler.iteration_tokens.bounds,
            iteration_token_counts=tuple(scheduler.iteration_tokens.counts),
            iteration_tokens_sum=scheduler.iteration_tokens.total,
        )

    def _spec_decode_stats(self) -> SpecDecodeStats | None:
        if self.speculator is None:
            return None
        return self.scheduler.spec_decode.snapshot(self.speculator.config.num_speculative_tokens)

    def describe(self) -> EngineDescription:
        """What this engine is, as built (fixed for its life)."""
        config = self.config
        return EngineDescription(
            model=config.model, dtype=config.dtype, quantized_matmul=quantized_matmul_name(self.model),
            max_model_len=self.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
            num_threads=torch.get_num_threads(),
            kv_cache=KVCacheDescription(
                num_blocks=self.kv_cache.num_blocks, block_size=self.kv_cache.block_size,
                num_bytes=self.kv_pool_bytes, sizing_reason=self.kv_pool.reason,
                enable_prefix_caching=self.kv_cache.enable_prefix_caching, dtype=config.dtype,
            ),
        )

    def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache's free blocks (blocks in use keep theirs); returns how many."""
        return self.kv_cache.reset_prefix_cache()

    # --- outputs -----------------------------------------------------------------------------------

    def pop_failures(self) -> dict[str, Exception]:
        """Requests that failed (and were aborted) during the last steps, with their errors."""
        failed, self._failed = self._failed, []
        return {group.request_id: group.failure for group in failed if group.failure is not None}

    def _make_outputs(
        self, advanced: list[tuple[Request, int]], logprobs: dict[str, list[dict[int, float]]],
        failed: dict[str, tuple[Request, Exception]],
    ) -> list[RequestOutput]:
        """failed: requests whose step failed (runner), by id: their groups fail, whatever they sampled."""
        groups: dict[str, RequestGroup] = {}  # in order of first appearance
        for request, error in failed.values():
            _log_failure(request.group_id, error)
            groups.setdefault(request.group_id, self._groups[request.group_id]).failure = error
        for request, num_new in advanced:
            group = groups.setdefault(request.group_id, self._groups[request.group_id])
            if request.request_id in failed:
                continue
            try:
                self._process_tokens(group.sequences[request.sample_index], num_new, logprobs.get(request.request_id))
            except Exception as error:  # one request's fault must not take the others down
                _log_failure(request.group_id, error)
                group.failure = error
        outputs = []
        for group in groups.values():
            if group.failure is not None:
                self.abort_request(group.request_id)
                self._failed.append(group)
                continue
            self._release_deferred(group)
            outputs.append(group.output())
            if group.finished:
                del self._groups[group.request_id]
        return outputs

    def _process_tokens(self, sequence: SequenceText, num_new: int, logprobs: list[dict[int, float]] | None) -> None:
        """The step's new tokens through logprobs, grammar and text, one at a time as decoding would see
        them; a stop found before the last one (a stop string, the grammar's end) drops the rest."""
        request = sequence.request
        first = request.num_output_tokens - num_new
        # The scheduler's stop checks (eos, stop ids, length) cut the run at the token that ended it.
        ended_by_scheduler = request.is_finished
        for index in range(num_new):
            last = index == num_new - 1
            row_logprobs = None if logprobs is None else logprobs[index]
            if self._process_token(sequence, first + index, row_logprobs, ended_by_scheduler and last) and not last:
                request.truncate_output(first + index + 1)
                return

    def _process_token(
        self, sequence: SequenceText, position: int, logprobs: dict[int, float] | None, ended: bool
    ) -> bool:
        """One new token; `ended`: the scheduler ended the request at it. Returns whether the token ends the
        output here by the grammar's end or a stop string (which then is the reason shown, also when the
        same token reached max_tokens)."""
        request = sequence.request
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        token_id = request.output_token_ids[position]
        grammar_ended = request.grammar is not None and not ended and self._advance_grammar(request.grammar, token_id)
        if grammar_ended:
            self._stop(request, None)
        stop = sequence.add_token(token_id)
        if stop is not None:
            self._stop(request, stop)
        return grammar_ended or stop is not None

    def _stop(self, request: Request, stop_reason: str | None) -> None:
        self.scheduler.finish(request, FinishReason.STOP)
        request.finish_reason, request.stop_reason = FinishReason.STOP, stop_reason

    def _advance_grammar(self, grammar: GrammarMatcher, token_id: int) -> bool:
        """The kept token through the request's grammar; True where the grammar ends (and so the request)."""
        if not grammar.accept_tokens([token_id]):  # the mask allowed it: a refusal is the grammar engine's fault
            raise GrammarStateError(f"the grammar refused token {token_id} that its own mask allowed")
        return grammar.is_terminated()

    def _release_deferred(self, group: RequestGroup) -> None:
        """The first sample has its first token, so its prompt blocks are cached: queue the rest first, in order."""
        for request in reversed(group.deferred):
            self.scheduler.add_request(request, front=True)
        group.deferred = []


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return request.first_scheduled_time - request.arrival_time


def _log_failure(group_id: str, error: Exception) -> None:
    """A constraint breaking mid-generation is the client's input (a 400): one line; anything else, a traceback."""
    if isinstance(error, GrammarStateError):
        logger.info("request %s: its output constraint broke: %s", group_id, error)
    else:
        logger.error("request %s failed", group_id, exc_info=error)
