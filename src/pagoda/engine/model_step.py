"""One step as the model runs it: `ModelStep`, a compact description of it, and `ModelExecution`, one rank's
model and KV cache running one.

The runner turns the scheduler's output into a ModelStep: the step's token ids, its attention layout (query
lengths, sequence lengths and block tables: integers only) and the rows whose logits it needs. That is all a
rank needs to run its share of the forward, so under tensor parallelism it is what reaches the workers, once per
step (engine/multiproc_executor.py); requests, sampling and grammars stay with the runner on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from pagoda.config import EngineConfig
from pagoda.engine.rank_placement import StageLinks
from pagoda.kv_groups import KVCacheGroup, layer_tensor_index
from pagoda.model.attention import AttentionMetadata, QueryLayout
from pagoda.model.kv_cache import LayerKV
from pagoda.model.llama import LlamaModel
from pagoda.model.loader import TORCH_DTYPES, load_model, load_model_config
from pagoda.model.lora import LoRAStack, attach_lora
from pagoda.model.parallel import TensorParallel
from pagoda.model.pipeline import PipelineStage


@dataclass(frozen=True)
class ModelStep:
    """What every rank computes in one step."""

    input_ids: list[int]
    layout: QueryLayout
    # One compute_logits call per entry, in this order: the rows of the flat batch it takes. Split across
    # ranks, each call gathers the vocabulary, so every rank makes the same calls.
    logits_rows: list[list[int]]
    # Rows whose final hidden states (after the final norm) the step returns too, after the logits: embeddings'.
    hidden_rows: list[int] = field(default_factory=list)


class StepExecution(Protocol):
    """Runs ModelSteps on a model and its KV cache (on rank 0 under tensor parallelism: with the other ranks)."""

    model: LlamaModel
    kv_caches: list[LayerKV]
    block_size: int

    def run(self, step: ModelStep) -> list[torch.Tensor]:
        """The step's forward; returns the logits of each entry of step.logits_rows, fp32 [rows, vocab], then, if
        step.hidden_rows, those rows' final hidden states, fp32 [rows, hidden]."""
        ...


class ModelExecution:
    """One rank's model and its paged KV cache, the one owner of it: per layer a `LayerKV`, K and V
    `[num_blocks * block_size, kv_heads, head_dim]` in `cache_dtype`'s format (with int8's per-token scales),
    kv_heads being this rank's share. With several KV cache groups (pagoda/kv_groups.py) a group's size of such
    tensors is allocated, and layer i of every group shares tensor i: a block id is held by one group at a time,
    and names its slice of the tensors of that group's layers."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: str = "cpu",
                 cache_dtype: str = "auto", calculate_kv_scales: bool = False, links: StageLinks | None = None,
                 groups: Sequence[KVCacheGroup] = ()) -> None:
        """links: with pipeline stages, this rank's links to the stages before and after it (its model is its
        stage's, its KV cache its stage's layers'). groups: the KV manager's KV cache groups (none: one table
        over every layer)."""
        self.model = model
        self.links = links
        self.block_size = block_size
        self.device = device
        config = model.config
        # Each layer's group, where a step's block tables differ by group.
        self.layer_groups = [0] * config.num_layers
        for index, group in enumerate(groups):
            for layer in group.layers:
                self.layer_groups[layer] = index
        tensor_of_layer = layer_tensor_index(groups, config.num_layers) if groups else list(range(config.num_layers))
        # Not zero-filled: a page of the pool becomes resident when a token's K/V is first written there, so an
        # idle engine's memory is its model's. Attention reads only slots it has written (build_metadata).
        tensors = [
            LayerKV.allocate(num_blocks * block_size, config.num_kv_heads, config.head_dim, model.dtype, cache_dtype,
                             device, calculate_kv_scales)
            for _ in range(max(tensor_of_layer) + 1)
        ]
        self.kv_caches: list[LayerKV] = [tensors[index] for index in tensor_of_layer]
        self.windows = set(config.sliding_windows) or {None}

    @torch.inference_mode()
    def run(self, step: ModelStep) -> list[torch.Tensor]:
        if self.links is not None:
            return self._run_stage(step, self.links)
        input_ids, positions, meta = self._inputs(step.input_ids, step.layout)
        return self._outputs(step, self.model(input_ids, positions, self.kv_caches, meta))

    def _inputs(self, input_ids: list[int], layout: QueryLayout) -> tuple[torch.Tensor, torch.Tensor,
                                                                           AttentionMetadata]:
        meta = layout.metadata(self.block_size, self.windows, self.layer_groups)
        return torch.tensor(input_ids, dtype=torch.long, device=self.device), meta.positions.to(self.device), meta

    def _outputs(self, step: ModelStep, hidden: torch.Tensor) -> list[torch.Tensor]:
        outputs = [self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
                   for rows in step.logits_rows]
        if step.hidden_rows:
            outputs.append(hidden[torch.tensor(step.hidden_rows, device=self.device)].float())
        return outputs

    def _run_stage(self, step: ModelStep, links: StageLinks) -> list[torch.Tensor]:
        """This rank's pipeline stage of the step, in micro-batches: each is handed on as soon as it is done, so
        that the next stage computes it while this one computes the next. Every rank cuts the step alike. The last
        stage computes the outputs from all of them at once, as one process would; rank 0 then receives them."""
        # fp8 scales still to calculate come from a step's first write: the whole step's, as in one process.
        parts = 1 if self.kv_caches[0].scales_pending else links.micro_batches
        runs = step.layout.split(parts, links.micro_batch_min_tokens)
        hidden = []
        for layout, tokens in runs:
            input_ids, positions, meta = self._inputs(step.input_ids[tokens], layout)
            received = None if links.previous is None else links.receive(len(input_ids))
            if links.next is None:
                hidden.append(self.model(input_ids, positions, self.kv_caches, meta, received))
            else:
                links.send(self.model.forward_stage(input_ids, positions, self.kv_caches, meta, received))
        if links.next is not None:
            links.wait_sent()
            if links.rank != 0:
                return []
            return links.receive_outputs([len(rows) for rows in step.logits_rows], len(step.hidden_rows))
        outputs = self._outputs(step, hidden[0] if len(hidden) == 1 else torch.cat(hidden))
        links.send_outputs(outputs)
        return outputs


def kv_layer_tensors(kv_caches: list[LayerKV]) -> list[tuple[torch.Tensor, ...]]:
    """Every slot-major tensor of each layer's KV cache, in order (int8's scales beside its codes): what copying a
    block copies rows of."""
    return [cache.tensors() for cache in kv_caches]


def load_engine_model(config: EngineConfig, parallel: TensorParallel | None = None,
                      stage: PipelineStage | None = None) -> LlamaModel:
    """The engine's model as the config asks for it: whole, or one rank's share of it (its tensor-parallel shard
    of its pipeline stage's layers)."""
    torch.manual_seed(config.seed)
    model, _ = load_model(
        config.model, dtype=TORCH_DTYPES[config.dtype], device=config.device, quantization=config.quantization,
        use_kernels=config.use_kernels, quantization_config=config.quantization_config, parallel=parallel,
        pipeline=stage,
    )
    return model


def attach_engine_lora(config: EngineConfig, model: LlamaModel) -> LoRAStack | None:
    """The adapter slots config.lora asks for on this rank's model (None: LoRA is off); a tensor-parallel rank's
    hold its share of each adapter."""
    if config.lora is None:
        return None
    return attach_lora(model, config.lora.max_loras, config.lora.max_lora_rank, load_model_config(config.model))


@dataclass(frozen=True)
class RankReport:
    """What one rank holds and runs, for the engine's report: its weights' and KV cache's bytes, and whether its
    decode steps run through the native decode stack (model/native_decode.py) rather than the modules."""

    weight_bytes: int
    kv_bytes: int
    native_decode: bool


def rank_report(model: LlamaModel, kv_caches: list[LayerKV]) -> RankReport:
    return RankReport(weight_bytes(model), kv_bytes(kv_caches), model.backend.decode_runner is not None)


def weight_bytes(model: LlamaModel) -> int:
    """The bytes of the model's weights as held: its parameters (a tied embedding and LM head counted once) and
    persistent buffers (quantized layers' codes and scales; not rotary's cos/sin tables, which are computed)."""
    buffers = [buffer for module in model.modules() for name, buffer in module.named_buffers(recurse=False)
               if name not in module._non_persistent_buffers_set]
    # By storage: a kernel layer wrapping a tied LM head holds the embedding's very bytes as a parameter of its own.
    held = {(tensor.data_ptr(), tensor.numel() * tensor.element_size()) for tensor in [*model.parameters(), *buffers]}
    return sum(size for _, size in held)


def weight_bytes_read_per_step(model: nn.Module) -> int:
    """The bytes of weights a dense model's decode step streams, as stored (quantization scales included): every
    parameter and persistent buffer once, less the input embedding's table (a step indexes one row of it a token;
    a tied LM head reads the shared table, counted once) and non-persistent tables (rotary cos/sin, rows indexed
    by position). A mixture of experts' routed experts all count, though a step reads only those chosen."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        skipped = module._non_persistent_buffers_set
        tensors = [*module.parameters(recurse=False),
                   *(buffer for name, buffer in module.named_buffers(recurse=False) if name not in skipped)]
        for tensor in tensors:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes(kv_caches: list[LayerKV]) -> int:
    """The bytes of a KV cache's tensors (scales included), allocated whether or not their pages are touched yet; a
    tensor that layers of several KV cache groups share counted once."""
    distinct = {id(cache): cache for cache in kv_caches}.values()
    return sum(tensor.numel() * tensor.element_size() for cache in distinct for tensor in cache.tensors())
