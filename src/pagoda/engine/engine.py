"""LLMEngine: step() = schedule -> execute -> update."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import torch

from pagoda.config import EngineConfig
from pagoda.engine.kv_cache import KVCacheManager
from pagoda.engine.output import IncrementalDetokenizer, RequestOutput, SequenceText
from pagoda.engine.request import FinishReason, Request
from pagoda.engine.runner import ModelRunner
from pagoda.engine.scheduler import Scheduler
from pagoda.model.loader import load_model
from pagoda.model.tokenizer import load_tokenizer
from pagoda.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The request can never run (too long for the context, bad token ids, ...): a 400, not a 500."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def _num_kv_blocks(config: EngineConfig, bytes_per_token: int) -> int:
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    return config.cache.kv_cache_memory_bytes // (bytes_per_token * config.cache.block_size)


def _derive_seed(seed: int, sample_index: int) -> int:
    """Seeds for the n samples of one request: distinct, and reproducible from the user's seed."""
    return seed if sample_index == 0 else random.Random(seed * 1_000_003 + sample_index).getrandbits(63)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        self.tokenizer = load_tokenizer(config.model)
        model_max_len = config.scheduler.max_model_len
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=config.device, quantization=config.quantization,
            use_kernels=config.use_kernels,
        )
        bytes_per_token = self.model_config.kv_bytes_per_token(config.dtype)
        num_blocks = _num_kv_blocks(config, bytes_per_token)
        max_model_len = self._fit_max_model_len(model_max_len, num_blocks * config.cache.block_size)
        self.config = replace(config, scheduler=replace(config.scheduler, max_model_len=max_model_len))
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache)
        self.runner = ModelRunner(self.model, num_blocks, config.cache.block_size, config.device)
        self.eos_token_ids = self._eos_token_ids()
        self._texts: dict[str, SequenceText] = {}  # per Request
        self._groups: dict[str, list[Request]] = {}  # user request id -> its n samples
        self._prompts: dict[str, str | None] = {}
        self._seed_source = random.Random(config.seed)
        self._failures: dict[str, Exception] = {}  # user request id -> what broke it
        # n > 1: samples after the first wait here until it has computed the prompt, then find
        # the prompt's blocks in the prefix cache instead of computing them again.
        self._deferred: dict[str, list[Request]] = {}
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), max_model_len %d",
            num_blocks, config.cache.block_size, num_blocks * config.cache.block_size * bytes_per_token / 2**20,
            max_model_len,
        )

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
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids, prompt_text = self._tokenize(prompt)
        self.validate(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        samples = []
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
            )
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            self._texts[request.request_id] = SequenceText(request, detokenizer)
            samples.append(request)
        self._groups[request_id] = samples
        self._prompts[request_id] = prompt_text
        share_prompt = len(samples) > 1 and self.kv_cache.enable_prefix_caching
        if share_prompt:
            self._deferred[request_id] = samples[1:]
        for request in samples[:1] if share_prompt else samples:
            self.scheduler.add_request(request)

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True), prompt
        return list(prompt), None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected for a request that can never run. Reads only config: thread-safe."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
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
            for request in self._groups.pop(group_id, []):
                self.scheduler.finish(request, FinishReason.ABORT)
                self._texts.pop(request.request_id, None)
            self._prompts.pop(group_id, None)
            self._deferred.pop(group_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.runner.execute(scheduler_output)
        self._record_prompt_logprobs(runner_output.prompt_logprobs)
        advanced = self.scheduler.update(scheduler_output, runner_output.sampled)
        return self._make_outputs(advanced, runner_output.logprobs)

    def _record_prompt_logprobs(self, chunks: dict[str, tuple[int, list[dict[int, float]]]]) -> None:
        for request_id, (start, logprobs) in chunks.items():
            request = self.scheduler.requests[request_id]
            # After a preemption the prompt is recomputed: keep only positions not yet recorded.
            request.prompt_logprobs.extend(logprobs[len(request.prompt_logprobs) - start :])

    # --- outputs -----------------------------------------------------------------------------------

    def pop_failures(self) -> dict[str, Exception]:
        """Requests that failed (and were aborted) during the last steps, with their errors."""
        failures, self._failures = self._failures, {}
        return failures

    def _make_outputs(self, advanced: list[Request], logprobs: dict[str, dict[int, float]]) -> list[RequestOutput]:
        groups = []
        for request in advanced:
            try:
                self._process_token(request, logprobs.get(request.request_id))
            except Exception as error:  # one request's fault must not take the others down
                logger.exception("request %s failed", request.group_id)
                self._failures[request.group_id] = error
            if request.group_id not in groups:
                groups.append(request.group_id)
        for group_id in self._failures:
            self.abort_request(group_id)
        for request in advanced:
            self._release_deferred(request)
        return [self._group_output(group_id) for group_id in groups if group_id in self._groups]

    def _process_token(self, request: Request, logprobs: dict[int, float] | None) -> None:
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        stop = self._texts[request.request_id].add_token(request.output_token_ids[-1])
        if stop is not None:
            self.scheduler.finish(request, FinishReason.STOP)
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop

    def _release_deferred(self, first: Request) -> None:
        """Once the first sample has its first token, its prompt blocks are cached: admit the rest."""
        for request in reversed(self._deferred.pop(first.group_id, [])):
            self.scheduler.add_request(request, front=True)

    def _group_output(self, group_id: str) -> RequestOutput:
        samples = self._groups[group_id]
        finished = all(r.is_finished for r in samples)
        output = RequestOutput(
            request_id=group_id,
            prompt=self._prompts[group_id],
            prompt_token_ids=samples[0].prompt_token_ids,
            outputs=[self._texts[r.request_id].completion(r.sample_index) for r in samples],
            finished=finished,
            num_cached_tokens=samples[0].num_cached_tokens,
            queue_time=_queue_time(samples[0]),
            prompt_logprobs=[None, *samples[0].prompt_logprobs] if samples[0].needs_prompt_logprobs else None,
        )
        if finished:
            del self._groups[group_id]
            del self._prompts[group_id]
            for request in samples:
                del self._texts[request.request_id]
        return output


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return request.first_scheduled_time - request.arrival_time
