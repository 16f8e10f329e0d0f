"""LLMEngine: step() = schedule -> execute_model -> update -> process outputs.

The engine holds the parts engine_parts.py builds and steps them; input processing (input_processor.py),
output processing (output_processor.py) and the fan-out and fan-in of `n` samples (parallel_sampling.py)
are modules of their own. The model is reached through one call, the executor's `execute_model`
(engine/executor.py): in this process, or split across tensor-parallel ranks, which the engine never sees.
"""

from __future__ import annotations

import time

import torch

from pagoda.config import EngineConfig
from pagoda.engine.api import (
    EngineDescription,
    EngineStats,
    KVCacheDescription,
    KVEventSink,
    RequestOutput,
    SpecDecodeStats,
)
from pagoda.engine.core.request import FinishReason
from pagoda.engine.core.runner_output import PromptLogprobsChunk
from pagoda.engine.core.step_budget import StepCostModel
from pagoda.engine.engine_parts import build_engine_parts
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.output_processor import OutputProcessor, SequenceText
from pagoda.engine.parallel_sampling import RequestGroup
from pagoda.model.loader import checkpoint_num_parameters
from pagoda.model.quantization import quantized_matmul_name
from pagoda.sampling import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, step_cost: StepCostModel | None = None,
                 kv_events: KVEventSink | None = None) -> None:
        """step_cost: how the scheduler predicts a step's time (default: LinearStepCost, learnt online).
        kv_events: where the KV cache reports blocks stored and removed (default: nowhere)."""
        parts = build_engine_parts(config, step_cost, kv_events)
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.model = parts.model
        self.model_config = parts.model_config
        self.kv_pool = parts.kv_pool
        self.kv_pool_bytes = parts.kv_pool_bytes
        self.kv_cache = parts.kv_cache
        self.eos_token_ids = parts.eos_token_ids
        self.structured = parts.structured
        self.draft_proposer = parts.draft_proposer
        self.speculator = parts.speculator
        self.scheduler = parts.scheduler
        self.executor = parts.executor
        self.runner = parts.runner
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.scheduler, self.model_config.vocab_size, self.eos_token_ids,
            self.structured, self.config.seed,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._failed: list[RequestGroup[SequenceText]] = []  # failed (and aborted) since the last pop_failures()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # --- the vLLM-shaped API -----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        inputs = self.input_processor.process_inputs(request_id, prompt, params, cache_salt, priority)
        group = self.output_processor.add_request(request_id, inputs.prompt, inputs.samples)
        for request in group.start(defer=self.kv_cache.enable_prefix_caching):
            self.scheduler.add_request(request)

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises RequestRejected for a request that can never run. Thread-safe (input_processor.py)."""
        self.input_processor.validate(prompt_ids, params, priority)

    def abort_request(self, request_id: str | list[str]) -> None:
        for group_id in [request_id] if isinstance(request_id, str) else request_id:
            group = self.output_processor.pop(group_id)
            if group is not None:
                self.scheduler.finish_requests(group.requests, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        self._record_prompt_logprobs(runner_output.prompt_logprobs)
        core_outputs = self.scheduler.update(scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(processed.stopped, FinishReason.STOP)
        for group in processed.failed:
            self.scheduler.finish_requests(group.requests, FinishReason.ABORT)
            self._failed.append(group)
        for request in processed.to_schedule_first:
            self.scheduler.add_request(request, front=True)
        # The whole step, as a decoding stream waits for it, teaches the scheduler's step-time model.
        self.scheduler.observe_step(scheduler_output, time.perf_counter() - started)
        return processed.request_outputs

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
            model=config.model, num_parameters=checkpoint_num_parameters(config.model), dtype=config.dtype,
            quantized_matmul=quantized_matmul_name(self.model),
            max_model_len=self.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
            num_threads=torch.get_num_threads(),
            kv_cache=KVCacheDescription(
                num_blocks=self.kv_cache.num_blocks, block_size=self.kv_cache.block_size,
                num_bytes=self.kv_pool_bytes, sizing_reason=self.kv_pool.reason,
                enable_prefix_caching=self.kv_cache.enable_prefix_caching, dtype=config.cache.kv_dtype(config.dtype),
            ),
            tensor_parallel_size=self.executor.tensor_parallel_size,
        )

    def check_health(self) -> None:
        """Raises EngineDeadError when no step can run any more (a tensor-parallel rank has gone)."""
        self.executor.check_health()

    def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache's free blocks (blocks in use keep theirs); returns how many."""
        return self.kv_cache.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops what the engine started (tensor-parallel workers); idempotent. The engine cannot step after it."""
        self.executor.shutdown()

    def pop_failures(self) -> dict[str, Exception]:
        """Requests that failed (and were aborted) during the last steps, with their errors."""
        failed, self._failed = self._failed, []
        return {group.request_id: group.failure for group in failed if group.failure is not None}
