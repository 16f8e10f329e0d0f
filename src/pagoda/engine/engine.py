"""LLMEngine: step() = schedule -> execute_model -> update -> process outputs.

The engine holds the parts engine_parts.py builds and steps them; input processing (input_processor.py),
output processing (output_processor.py) and the fan-out and fan-in of `n` samples (parallel_sampling.py)
are modules of their own. The model is reached through one call, the executor's `execute_model`
(engine/executor.py): in this process, or split across ranks (tensor-parallel, pipeline stages), which the engine
never sees.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.engine.api import (
    EngineDescription,
    EngineOutput,
    EngineStats,
    ExpertLoadStats,
    KVCacheDescription,
    KVConnectorStats,
    KVEventSink,
    LoRAStats,
    RequestRejected,
    SpecDecodeStats,
    TenantShare,
)
from pagoda.engine.core.hybrid_kv_cache import HybridKVCacheManager
from pagoda.engine.core.lora import AdapterId, distinct_adapters
from pagoda.engine.core.queues import blocks_held_by_tenant
from pagoda.engine.core.request import FinishReason
from pagoda.engine.core.runner_output import PromptLogprobsChunk
from pagoda.engine.core.step_budget import StepCostModel
from pagoda.engine.engine_parts import build_engine_parts
from pagoda.engine.external_ranks import run_if_worker_rank
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.model_step import weight_bytes_read_per_step
from pagoda.engine.output_processor import OutputProcessor, SequenceText
from pagoda.engine.parallel_sampling import RequestGroup
from pagoda.engine.pooling_requests import NOT_A_GENERATE_ENGINE, PoolingRequests
from pagoda.kv_groups import blocks_per_sequence
from pagoda.lora_request import LoRARequest
from pagoda.model.loader import checkpoint_num_parameters
from pagoda.model.lora_checkpoint import LoRALoadError
from pagoda.model.moe import routed_token_counts
from pagoda.model.quantization import quantized_matmul_name
from pagoda.pooling import PoolingParams
from pagoda.sampling import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, step_cost: StepCostModel | None = None,
                 kv_events: KVEventSink | None = None) -> None:
        """step_cost: how the scheduler predicts a step's time (default: LinearStepCost, learnt online).
        kv_events: where the KV cache reports blocks stored and removed (default: nowhere).
        Under the external launcher, on a rank other than 0, this serves rank 0 and then ends the process."""
        run_if_worker_rank(config)
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
        self.num_threads = torch.get_num_threads()  # each step's, on each rank, as built (the executor set it)
        self.runner = parts.runner
        self.trace = parts.trace  # records steps as a timeline while started (step_trace.py)
        self.lora = parts.runner.lora  # None: LoRA adapters are off
        self.kv_connector = parts.kv_connector
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.scheduler, self.model_config.vocab_size, self.eos_token_ids,
            self.structured, self.config.seed,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Embedding requests (pooling.py); with the generate runner it only refuses them.
        self.pooling = PoolingRequests(self.tokenizer, self.config.scheduler, self.model_config.vocab_size,
                                       parts.pooling)
        self._failed: list[RequestGroup[SequenceText]] = []  # failed (and aborted) since the last pop_failures()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # --- the vLLM-shaped API -----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
        cache_salt: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None,
        tenant: TenantShare | None = None,
    ) -> None:
        """params: SamplingParams to generate, PoolingParams to embed (the pooling runner's only kind).
        lora_request: the LoRA adapter to run the request with (None: the base model); tenant: whose it is."""
        if request_id in self.output_processor or request_id in self.pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise RequestRejected("LoRA adapters are not supported with embedding requests", "model")
            self.scheduler.add_request(self.pooling.add(request_id, prompt, params, cache_salt, priority))
            return
        self._check_generates()
        self._check_kv_transfer(params)
        adapter = None if lora_request is None else self.add_lora(lora_request)
        inputs = self.input_processor.process_inputs(request_id, prompt, params, cache_salt, priority, adapter,
                                                     tenant)
        group = self.output_processor.add_request(request_id, inputs.prompt, inputs.samples)
        for request in group.start(defer=self.kv_cache.enable_prefix_caching):
            self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> AdapterId:
        """Loads and checks an adapter (or finds it loaded); RequestRejected says why it cannot be served."""
        if self.lora is None:
            raise RequestRejected(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                                  "(enable_lora=True, --enable-lora)", "model")
        try:
            return self.lora.resolve(lora_request)
        except LoRALoadError as error:
            raise RequestRejected(str(error), "model") from error

    def remove_lora(self, name: str) -> None:
        """Frees the adapter's loaded weights; requests already on it keep running (they read it again if they
        must)."""
        if self.lora is not None:
            scheduler = self.scheduler
            in_use = distinct_adapters(request.lora for request in [*scheduler.running, *scheduler.waiting])
            self.lora.forget(name, in_use)

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises RequestRejected for a request that can never run. Thread-safe (input_processor.py)."""
        self._check_generates()
        self._check_kv_transfer(params)
        self.input_processor.validate(prompt_ids, params, priority)

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """kv_transfer_params asks for what this engine's connector does: holding a prompt's KV for a decode
        replica (a producer), or pulling it (a consumer)."""
        transfer = params.kv_transfer_params
        if transfer is None:
            return
        config = self.config.kv_transfer_config
        is_tcp = config is not None and config.kv_connector == "TcpConnector"
        if transfer.do_remote_decode and not (is_tcp and config is not None and config.saves):
            raise RequestRejected("kv_transfer_params.do_remote_decode needs a prefill replica: --kv-transfer-config "
                                  'with "kv_connector": "TcpConnector" and kv_role kv_producer or kv_both',
                                  "kv_transfer_params")
        if transfer.do_remote_prefill and not (is_tcp and config is not None and config.loads):
            raise RequestRejected("kv_transfer_params.do_remote_prefill needs a decode replica: --kv-transfer-config "
                                  'with "kv_connector": "TcpConnector" and kv_role kv_consumer or kv_both',
                                  "kv_transfer_params")

    def pull_remote_kv(self, params: SamplingParams, prompt: str | list[int] | None = None,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> int:
        """Pulls the prompt KV a prefill replica holds for this request (kv_transfer_params.do_remote_prefill) to
        where admitting the request finds it; returns the blocks that arrived (0: it computes its prompt).
        With the prompt (and its cache salt), the leading blocks this engine's prefix cache already holds are not
        pulled, only those after them (an adapter's prompt pulls every block: its blocks hash with the adapter,
        resolved at admission). Thread-safe, and meant to run off the engine thread, before add_request: the
        engine steps meanwhile."""
        transfer = params.kv_transfer_params
        remote = None if self.kv_connector is None else self.kv_connector.remote
        if transfer is None or not transfer.do_remote_prefill or remote is None:
            return 0
        local = 0
        if prompt is not None and lora_request is None:
            local = self.kv_cache.cached_prefix_blocks(self.input_processor.prompt_ids(prompt), cache_salt)
        return remote.pull(transfer, skip_blocks=min(local, len(transfer.remote_block_ids)))

    def release_sent_blocks(self) -> None:
        """Blocks the KV connector held for finished requests (a prefill replica's, for a decode replica to pull)
        that it no longer needs go back to the pool: before each step, and while the async engine idles."""
        if self.kv_connector is not None:
            for request_id in self.kv_connector.scheduler.finished_sending():
                self.kv_cache.release_held(request_id)

    def validate_embedding(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """Raises RequestRejected for an embedding request that can never run (pooling_requests.py). Thread-safe."""
        self.pooling.validate(prompt_ids, params)

    def _check_generates(self) -> None:
        if self.config.runner == "pooling":
            raise RequestRejected(NOT_A_GENERATE_ENGINE, "model")

    def abort_request(self, request_id: str | list[str]) -> None:
        for group_id in [request_id] if isinstance(request_id, str) else request_id:
            group = self.output_processor.pop(group_id)
            if group is not None:
                self.scheduler.finish_requests(group.requests, FinishReason.ABORT)
            embedding = self.pooling.pop(group_id)
            if embedding is not None:
                self.scheduler.finish_requests([embedding], FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        started = time.perf_counter()
        self.trace.begin_step()
        self.release_sent_blocks()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self.trace.phase("execute")
        self.trace.describe_step(requests=len(scheduler_output.scheduled),
                                 tokens=scheduler_output.num_batched_tokens)
        runner_output = self.executor.execute_model(scheduler_output)
        self.trace.phase("update")
        self._record_prompt_logprobs(runner_output.prompt_logprobs)
        core_outputs = self.scheduler.update(scheduler_output, runner_output)
        self.trace.phase("outputs")
        embeddings, failed_embeddings, core_outputs = self.pooling.take_outputs(core_outputs)
        self.scheduler.finish_requests(failed_embeddings, FinishReason.ABORT)
        processed = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(processed.stopped, FinishReason.STOP)
        for group in processed.failed:
            self.scheduler.finish_requests(group.requests, FinishReason.ABORT)
            self._failed.append(group)
        for request in processed.to_schedule_first:
            self.scheduler.add_request(request, front=True)
        # The whole step, as a decoding stream waits for it, teaches the scheduler's step-time model.
        self.scheduler.observe_step(scheduler_output, time.perf_counter() - started)
        outputs: list[EngineOutput] = [*embeddings, *processed.request_outputs]
        self.trace.end_step(outputs)
        return outputs

    def _record_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        for request_id, (start, logprobs) in chunks.items():
            request = self.scheduler.requests[request_id]
            # After a preemption the prompt is recomputed: keep only positions not yet recorded.
            request.prompt_logprobs.extend(logprobs[len(request.prompt_logprobs) - start :])

    # --- state for metrics and maintenance ---------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        threads, thread_changes = self.executor.step_threads() or (self.num_threads, 0)
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage(),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            prompt_tokens_computed=scheduler.prompt_tokens_computed,
            kv_connector=self._kv_connector_stats(),
            spec_decode=self._spec_decode_stats(),
            iteration_token_buckets=scheduler.iteration_tokens.bounds,
            iteration_token_counts=tuple(scheduler.iteration_tokens.counts),
            iteration_tokens_sum=scheduler.iteration_tokens.total,
            lora=self._lora_stats(),
            experts=self._expert_load(),
            kv_blocks_by_tenant=tuple(sorted(blocks_held_by_tenant(scheduler.running).items())),
            step_threads=threads, step_thread_changes=thread_changes,
        )

    def _expert_load(self) -> ExpertLoadStats | None:
        expert_tokens = routed_token_counts(self.model)
        if expert_tokens is None:
            return None
        parallel = self.config.parallel
        ranks = parallel.tensor_parallel_size if parallel.enable_expert_parallel else 1
        per_rank = len(expert_tokens) // ranks
        rank_tokens = tuple(sum(expert_tokens[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))
        return ExpertLoadStats(tuple(expert_tokens), rank_tokens)

    def _lora_stats(self) -> LoRAStats | None:
        if self.lora is None:
            return None
        scheduler = self.scheduler
        running = distinct_adapters(request.lora for request in scheduler.running)
        waiting = distinct_adapters(request.lora for request in scheduler.waiting)
        return LoRAStats(tuple(dict.fromkeys(a.name for a in running)), tuple(dict.fromkeys(a.name for a in waiting)),
                         self.lora.max_loras, time.time())
    def _kv_connector_stats(self) -> KVConnectorStats | None:
        if self.kv_connector is None:
            return None
        scheduler = self.scheduler
        return KVConnectorStats(
            external_prefix_cache_queries=scheduler.external_prefix_cache_queries,
            external_prefix_cache_hits=scheduler.external_prefix_cache_hits, failed_loads=scheduler.failed_loads,
            tiers=tuple(self.kv_connector.worker.tier_stats()),
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
            weight_bytes_read_per_step=weight_bytes_read_per_step(self.model),
            max_model_len=self.max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
            num_threads=self.num_threads,
            kv_cache=KVCacheDescription(
                num_blocks=self.kv_cache.num_blocks, block_size=self.kv_cache.block_size,
                num_bytes=self.kv_pool_bytes, sizing_reason=self.kv_pool.reason,
                enable_prefix_caching=self.kv_cache.enable_prefix_caching, dtype=config.cache.kv_dtype(config.dtype),
                **self._kv_groups_description(),
            ),
            tensor_parallel_size=self.executor.tensor_parallel_size,
            pipeline_parallel_size=self.executor.pipeline_parallel_size, runner=config.runner,
        )

    def _kv_groups_description(self) -> dict[str, Any]:
        """The KV cache groups for the description, when there are several or a sliding one."""
        kv_cache = self.kv_cache
        if not isinstance(kv_cache, HybridKVCacheManager):
            return {}
        groups = kv_cache.groups
        windows = sorted({group.window for group in groups if group.window is not None})
        num_full = sum(1 for group in groups if group.window is None)
        num_sliding = len(groups) - num_full
        layout = (f"{num_full} full + {num_sliding} sliding-window ({', '.join(map(str, windows))}) groups "
                  f"of {len(groups[0].layers)} layers")
        per_sequence = blocks_per_sequence(groups, self.max_model_len, kv_cache.block_size)
        return {"groups": layout, "max_len_sequences": kv_cache.num_blocks // per_sequence}

    def check_health(self) -> None:
        """Raises EngineDeadError when no step can run any more (a rank of a split model has gone)."""
        self.executor.check_health()

    def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache's free blocks (blocks in use keep theirs); returns how many."""
        return self.kv_cache.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops what the engine started (tensor-parallel workers); idempotent. The engine cannot step after it."""
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.worker.shutdown()

    def pop_failures(self) -> dict[str, Exception]:
        """Requests that failed (and were aborted) during the last steps, with their errors."""
        failed, self._failed = self._failed, []
        embeddings, self.pooling.failures = self.pooling.failures, {}
        return {**{group.request_id: group.failure for group in failed if group.failure is not None}, **embeddings}
