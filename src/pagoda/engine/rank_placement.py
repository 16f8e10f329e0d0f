"""Where each rank of a split model stands: its tensor-parallel group and its pipeline stage, and the links that
carry a step's activations from stage to stage.

Ranks are numbered stage by stage: rank r is tensor-parallel rank r % T of stage r // T (T ranks a stage, vLLM's
order), so rank 0, the engine's process, is the first stage's first rank. Each stage's ranks all-reduce among
themselves (their own process group); from one stage to the next, each rank sends the residual stream to the rank
of the same tensor-parallel index (every rank of a stage holds the whole stream after its all-reduces), point to
point. The last stage's first rank sends rank 0 the step's outputs (logits, hidden rows), which rank 0 samples from:
the scheduler, sampler and detokenizer stay there and never know the stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.model import shm_all_reduce
from pagoda.model.loader import load_model_config
from pagoda.model.parallel import TensorParallel
from pagoda.model.pipeline import PipelineStage, StageActivations, pipeline_stage

# A step runs through the stages in micro-batches (model_step.ModelExecution), so that while one stage computes a
# micro-batch the stage before computes the next; the first and last micro-batches still find the other stages idle.
# On a CPU each micro-batch streams all of its stage's weights, so one of a few rows costs much of what 16 rows do:
# smaller ones would add weight reads rather than fill the pipeline.
MICRO_BATCHES_PER_STAGE = 2
MICRO_BATCH_MIN_TOKENS = 16


@dataclass(frozen=True)
class RankLayout:
    """The world of ranks: tensor_parallel_size ranks in each of pipeline_parallel_size stages."""

    tensor_parallel_size: int
    pipeline_parallel_size: int

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tensor_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_of(self, stage: int, tensor_rank: int) -> int:
        return stage * self.tensor_parallel_size + tensor_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_of(stage, tensor_rank) for tensor_rank in range(self.tensor_parallel_size)]


class StageLinks:
    """One rank's point-to-point links: from the stage before, to the stage after, and the step's outputs from the
    last stage to rank 0. Every tensor's shape follows from the step, which every rank has, so only data travels."""

    def __init__(self, layout: RankLayout, rank: int, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> None:
        stage, tensor_rank = layout.stage_of(rank), layout.tensor_rank_of(rank)
        last = layout.pipeline_parallel_size - 1
        self.rank = rank
        self.previous = None if stage == 0 else layout.rank_of(stage - 1, tensor_rank)
        self.next = None if stage == last else layout.rank_of(stage + 1, tensor_rank)
        self.output_source = layout.rank_of(last, 0)  # the last stage's first rank: its outputs go to rank 0
        self.hidden_size, self.vocab_size, self.dtype = hidden_size, vocab_size, dtype
        self.micro_batches = MICRO_BATCHES_PER_STAGE * layout.pipeline_parallel_size
        self.micro_batch_min_tokens = MICRO_BATCH_MIN_TOKENS
        self._sending: list[tuple[Any, torch.Tensor]] = []  # isend requests, and the tensors they read

    def receive(self, num_tokens: int) -> StageActivations:
        """The stage before's residual stream for the step's `num_tokens` tokens."""
        assert self.previous is not None, "the first stage embeds its tokens"
        buffer = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype)
        dist.recv(buffer, src=self.previous)
        return StageActivations(buffer[0], buffer[1])

    def send(self, activations: StageActivations) -> None:
        """Hands the activations on without waiting for the next stage to take them (`wait_sent` does)."""
        assert self.next is not None, "the last stage sends outputs, not activations"
        stacked = torch.stack((activations.residual, activations.delta))
        self._sending.append((dist.isend(stacked, dst=self.next), stacked))

    def wait_sent(self) -> None:
        """Returns once the next stage has taken everything sent to it."""
        for request, _ in self._sending:
            request.wait()
        self._sending.clear()

    def send_outputs(self, outputs: list[torch.Tensor]) -> None:
        """On the last stage: rank 0 gets the step's outputs from this stage's first rank (fp32, flattened)."""
        if self.rank == self.output_source and sum(output.numel() for output in outputs) > 0:
            dist.send(torch.cat([output.reshape(-1) for output in outputs]), dst=0)

    def receive_outputs(self, logits_rows: list[int], hidden_rows: int) -> list[torch.Tensor]:
        """On rank 0: the outputs send_outputs sent, as the last stage computed them: [rows, vocab] fp32 logits
        for each entry of logits_rows (its row count), then, if hidden_rows, [hidden_rows, hidden] fp32."""
        shapes = [(rows, self.vocab_size) for rows in logits_rows]
        if hidden_rows:
            shapes.append((hidden_rows, self.hidden_size))
        sizes = [rows * columns for rows, columns in shapes]
        buffer = torch.empty(sum(sizes), dtype=torch.float32)
        if buffer.numel():
            dist.recv(buffer, src=self.output_source)
        return [part.view(shape) for part, shape in zip(torch.split(buffer, sizes), shapes)]


@dataclass(frozen=True)
class RankPlacement:
    """What one rank builds: its tensor-parallel place (None: its stage is one rank), its pipeline stage (None: one
    stage), and its links to the other stages (None: one stage)."""

    parallel: TensorParallel | None
    stage: PipelineStage | None
    links: StageLinks | None


def place_rank(config: EngineConfig, rank: int, dtype: torch.dtype) -> RankPlacement:
    """This rank's placement. Collective: every rank calls it, after joining the default process group, since
    each stage's group is made by all ranks together, in the same order."""
    tensor_size, pipeline_size = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    layout = RankLayout(tensor_size, pipeline_size)
    stage_index, tensor_rank = layout.stage_of(rank), layout.tensor_rank_of(rank)
    group = None
    if tensor_size > 1 and pipeline_size > 1:
        for stage in range(pipeline_size):
            stage_group = dist.new_group(layout.stage_ranks(stage))
            if stage == stage_index:
                group = stage_group
    parallel = None
    if tensor_size > 1:
        native = config.use_kernels and torch.device(config.device).type == "cpu"
        local = shm_all_reduce.connect(tensor_rank, tensor_size, group, f"stage{stage_index}") if native else None
        parallel = TensorParallel(tensor_rank, tensor_size, group, config.parallel.enable_expert_parallel, local)
    if pipeline_size == 1:
        return RankPlacement(parallel, None, None)
    model_config = load_model_config(config.model)
    links = StageLinks(layout, rank, model_config.hidden_size, model_config.vocab_size, dtype)
    return RankPlacement(parallel, pipeline_stage(model_config.num_layers, pipeline_size, stage_index), links)
