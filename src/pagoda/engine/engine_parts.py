"""Building an engine's parts: the tokenizer, the draft model, the KV pool, the executor that runs the model
(in this process or split across several), and what runs on them.

Construction happens once, here; LLMEngine then only steps them. The pool's size and the clamp of
max_model_len to it are decided here, from the checkpoint's config, before any weight is read or any worker
started, so that every part (every rank included) is built with the same, final values.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from pagoda.config import EngineConfig, ModelConfig
from pagoda.engine.api import KVEventSink
from pagoda.engine.core.hybrid_kv_cache import make_kv_cache_manager
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.core.speculative import Speculator
from pagoda.engine.core.step_budget import StepCostModel
from pagoda.engine.draft_model import DraftModelProposer, load_draft_model
from pagoda.engine.executor import Executor, UniProcExecutor
from pagoda.engine.grammar_masks import StructuredOutputs
from pagoda.engine.kv_connector.base import KVConnector
from pagoda.engine.kv_connector.factory import build_kv_connector
from pagoda.engine.kv_pool import KVPoolSize, kv_pool_size
from pagoda.engine.lora_manager import LoRAManager
from pagoda.engine.model_step import ModelExecution, attach_engine_lora, kv_layer_tensors, load_engine_model
from pagoda.engine.runner import DraftModel, ModelRunner
from pagoda.engine.step_trace import StepTrace
from pagoda.engine.thread_tuner import ThreadCountTuner
from pagoda.kv_groups import KVCacheGroup, blocks_per_sequence, is_hybrid, kv_cache_groups
from pagoda.model.expert_parallel import check_experts_divisible
from pagoda.model.llama import LlamaModel
from pagoda.model.loader import load_model_config
from pagoda.model.parallel import check_divisible, kv_heads_per_rank
from pagoda.model.pipeline import stage_layer_counts
from pagoda.model.quantized_shards import check_quantized_split
from pagoda.model_dir import ModelLoadError
from pagoda.pooling import PoolingConfig, load_pooling_config
from pagoda.text.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    config: EngineConfig  # as given, but with max_model_len clamped to the model and the KV pool
    tokenizer: Tokenizer
    model: LlamaModel
    model_config: ModelConfig
    kv_pool: KVPoolSize
    kv_pool_bytes: int  # target's and draft's KV together
    kv_cache: KVCacheManager
    eos_token_ids: tuple[int, ...]
    structured: StructuredOutputs
    draft_proposer: DraftModelProposer | None
    speculator: Speculator | None
    scheduler: Scheduler
    executor: Executor
    runner: ModelRunner  # rank 0's
    trace: StepTrace  # the steps' timeline, shared by the engine and rank 0's runner
    kv_connector: KVConnector | None
    pooling: PoolingConfig | None = None  # the pooling runner's (an embedding model); None: the generate runner


def build_engine_parts(
    config: EngineConfig, step_cost: StepCostModel | None = None, kv_events: KVEventSink | None = None
) -> EngineParts:
    """step_cost: how the scheduler predicts a step's time (default: LinearStepCost, learnt online).
    kv_events: where the KV cache reports blocks stored and removed (default: nowhere)."""
    torch.manual_seed(config.seed)
    tokenizer: Tokenizer = load_tokenizer(config.model)
    model_config = load_model_config(config.model)
    tensor_parallel_size = config.parallel.tensor_parallel_size
    if config.parallel.executor_backend == "mp":
        _check_splittable(config, model_config)
    speculative = config.speculative_config
    if speculative is not None and speculative.method == "draft_model" and config.kv_transfer_config is not None:
        raise ModelLoadError("a KV connector does not run with a draft model yet: the draft's KV is not offloaded")
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft, _ = load_draft_model(speculative, model_config, tokenizer, config.dtype, config.device,
                                    config.use_kernels)
    # A draft model's KV mirrors the target's slot for slot: the pool's bytes pay for both, and for every rank's
    # KV heads (a KV head on several ranks is paid for on each).
    kv_heads_held = kv_heads_per_rank(model_config.num_kv_heads, tensor_parallel_size) * tensor_parallel_size
    cache_dtype = config.cache.cache_dtype
    bytes_per_token = (
        model_config.kv_bytes_per_token(config.dtype, cache_dtype) * kv_heads_held // model_config.num_kv_heads
        + (0 if draft is None else draft.config.kv_bytes_per_token(draft.dtype, cache_dtype))
    )
    wanted_len = min(config.scheduler.max_model_len, model_config.max_position_embeddings)
    groups = choose_kv_cache_groups(config, model_config, wanted_len)
    block_size, chunk = config.cache.block_size, min(config.scheduler.max_num_batched_tokens, wanted_len)
    # A block holds one group's layers: with several groups, a block-token is that share of a token's KV.
    bytes_per_token = bytes_per_token * len(groups[0].layers) // model_config.num_layers
    kv_pool = kv_pool_size(config.cache, config.scheduler.max_num_seqs, wanted_len, bytes_per_token,
                           blocks_per_sequence(groups, wanted_len, block_size, chunk))
    num_blocks = kv_pool.num_blocks
    kv_pool_bytes = num_blocks * block_size * bytes_per_token
    max_model_len = _fit_max_model_len(wanted_len, num_blocks,
                                       lambda length: blocks_per_sequence(groups, length, block_size, chunk))
    config = replace(config, scheduler=replace(config.scheduler, max_model_len=max_model_len))
    pooling = load_pooling_config(config.model) if config.runner == "pooling" else None
    if config.kv_transfer_config is not None and config.cache.calculate_kv_scales:
        raise ModelLoadError("a KV connector does not run with calculate_kv_scales: fp8 blocks are only valid "
                             "under the layer scales they were written with, which each engine computes for itself")
    if pooling is not None and config.kv_transfer_config is not None:
        raise ModelLoadError("a KV connector does not run with the pooling runner: an embedding request keeps no "
                             "KV, and mean or CLS pooling needs every prompt position computed")
    # Mean and CLS pooling need every prompt position's hidden state, which a prefix hit does not have.
    prefix_caching = config.cache.enable_prefix_caching and (pooling is None or pooling.uses_prefix_hits)
    kv_cache = make_kv_cache_manager(num_blocks, block_size, groups, prefix_caching, kv_events)
    eos_token_ids = _eos_token_ids(model_config, tokenizer)
    structured = StructuredOutputs(tokenizer, model_config.vocab_size, eos_token_ids, config.grammar)
    draft_proposer = None if draft is None or speculative is None else DraftModelProposer(
        draft, speculative, num_blocks, block_size, config.scheduler.max_num_seqs, max_model_len, structured,
        config.device, config.cache.cache_dtype, config.cache.calculate_kv_scales,
    )
    speculator = None if speculative is None else Speculator(speculative, draft_proposer)
    trace = StepTrace()
    executor, kv_connector = build_executor(config, num_blocks, block_size, structured, draft_proposer, kv_cache,
                                            kv_events, trace, groups if is_hybrid(groups) else ())
    logger.info(
        "KV cache: %d blocks of %d tokens, %s (%.1f MiB; %s), max_model_len %d",
        num_blocks, block_size, config.cache.kv_dtype(config.dtype), kv_pool_bytes / 2**20, kv_pool.reason,
        max_model_len,
    )
    return EngineParts(
        config=config, tokenizer=tokenizer, model_config=model_config, kv_pool=kv_pool,
        kv_pool_bytes=kv_pool_bytes, kv_cache=kv_cache, eos_token_ids=eos_token_ids, structured=structured,
        draft_proposer=draft_proposer, speculator=speculator,
        scheduler=Scheduler(config.scheduler, kv_cache, speculator, step_cost,
                            max_loras=None if config.lora is None else config.lora.max_loras,
                            connector=None if kv_connector is None else kv_connector.scheduler),
        executor=executor, model=executor.runner.model, runner=executor.runner, trace=trace,
        kv_connector=kv_connector, pooling=pooling,
    )


def build_executor(config: EngineConfig, num_blocks: int, block_size: int, structured: StructuredOutputs,
                   draft: DraftModel | None, kv_cache: KVCacheManager, kv_events: KVEventSink | None = None,
                   trace: StepTrace | None = None, groups: Sequence[KVCacheGroup] = ()
                   ) -> tuple[Executor, KVConnector | None]:
    """The executor config.parallel asks for, its model loaded (every rank's, under tensor parallelism), and the
    KV connector config.kv_transfer_config names, over the KV pool's tensors (None: none). groups: the KV cache
    groups when there are several or a sliding one (none: one block table over every layer)."""
    if config.parallel.executor_backend == "uni":
        model = load_engine_model(config)
        stack = attach_engine_lora(config, model)
        lora = None if config.lora is None or stack is None else LoRAManager(config.lora, stack, stack.base_config)
        execution = ModelExecution(model, num_blocks, block_size, config.device, config.cache.cache_dtype,
                                   config.cache.calculate_kv_scales, groups=groups)
        connector = None if config.kv_transfer_config is None else build_kv_connector(
            config, config.kv_transfer_config, kv_layer_tensors(execution.kv_caches), block_size,
            kv_cache.block_hashes, kv_events)
        runner = ModelRunner(execution, structured, draft, lora=lora, trace=trace,
                             kv_connector=None if connector is None else connector.worker)
        return UniProcExecutor(runner, thread_tuner(config)), connector
    from pagoda.engine.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(config, num_blocks, block_size, structured, draft, trace, kv_cache.block_hashes,
                                 kv_events, tuple(groups))
    return executor, executor.kv_connector


def thread_tuner(config: EngineConfig) -> ThreadCountTuner | None:
    """The tuner that adapts the step's thread count to the cores free (None: the count stays as started)."""
    threads = torch.get_num_threads()
    if not config.parallel.cpu_threads_adapt or config.device != "cpu" or threads < 2:
        return None
    return ThreadCountTuner(threads, torch.set_num_threads)


def choose_kv_cache_groups(config: EngineConfig, model_config: ModelConfig, max_model_len: int
                           ) -> tuple[KVCacheGroup, ...]:
    """The model's KV cache groups (pagoda/kv_groups.py): a block table per group where the model has sliding
    windows shorter than the context, so that their out-of-window blocks return to the pool; one table over every
    layer otherwise, or where a part of the engine copies or mirrors blocks layer by layer through one table."""
    groups = kv_cache_groups(model_config.sliding_windows, model_config.num_layers, max_model_len)
    one_table = (KVCacheGroup(None, tuple(range(model_config.num_layers))),)
    if not is_hybrid(groups):
        return one_table
    speculative = config.speculative_config
    needs_one_table = [reason for reason, applies in (
        ("a draft model (its KV mirrors the target's slots)",
         speculative is not None and speculative.method == "draft_model"),
        ("speculative branches over several groups", speculative is not None and len(groups) > 1),
        ("a KV connector (it moves blocks of every layer)", config.kv_transfer_config is not None),
        ("pipeline stages", config.parallel.pipeline_parallel_size > 1),
    ) if applies]
    if needs_one_table:
        logger.info("sliding-window layers keep every block (one block table over all layers) with %s",
                    "; ".join(needs_one_table))
        return one_table
    return groups


def _check_splittable(config: EngineConfig, model_config: ModelConfig) -> None:
    """What a split model does not take yet (or a split it cannot make) is refused before anything is loaded or
    started."""
    size = config.parallel.tensor_parallel_size
    check_divisible(model_config, size)
    if model_config.moe is not None and size > 1:
        if not config.parallel.enable_expert_parallel:
            raise ModelLoadError(f"tensor_parallel_size {size} splits a mixture-of-experts model only with "
                                 "--enable-expert-parallel (enable_expert_parallel=True: each rank holds "
                                 f"{model_config.moe.num_experts} / {size} of the experts, whole)")
        check_experts_divisible(model_config.moe.num_experts, size)
    stage_layer_counts(model_config.num_layers, config.parallel.pipeline_parallel_size)
    check_quantized_split(config.model, model_config, size, config.quantization, config.quantization_config)
    unsupported = [
        reason for reason, applies in (
            (f"--device {config.device} (the ranks run on the CPU, over gloo)", config.device != "cpu"),
            ("--enable-lora (LoRA adapters) with pipeline stages",
             config.lora is not None and config.parallel.pipeline_parallel_size > 1),
            (f"the {_connector_name(config)} (only the OffloadingConnector, --kv-offloading-size, runs split)",
             config.kv_transfer_config is not None
             and config.kv_transfer_config.kv_connector != "OffloadingConnector"),
        ) if applies
    ]
    if unsupported:
        raise ModelLoadError(f"tensor_parallel_size {size} x pipeline_parallel_size "
                             f"{config.parallel.pipeline_parallel_size} does not run with {'; '.join(unsupported)} yet")


def _connector_name(config: EngineConfig) -> str:
    return "KV connector" if config.kv_transfer_config is None else config.kv_transfer_config.kv_connector


def _fit_max_model_len(wanted: int, num_blocks: int, blocks_of: Callable[[int], int]) -> int:
    """One full-length sequence must fit in the pool, or preemption could livelock. blocks_of: the blocks a
    sequence of a length holds at most (every group's), which grows with the length."""
    if blocks_of(wanted) <= num_blocks:
        return wanted
    low, high = 0, wanted  # the longest length that fits lies in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if blocks_of(middle) <= num_blocks else (low, middle)
    if low < 16:
        raise ValueError(f"KV cache holds only {low} tokens of a sequence; give it more memory or blocks")
    logger.warning("max_model_len clamped from %d to %d: the KV pool of %d blocks holds a sequence of %d tokens",
                   wanted, low, num_blocks, low)
    return low


def _eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
