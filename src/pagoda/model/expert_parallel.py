"""Expert parallelism (vLLM's --enable-expert-parallel): a mixture of experts' routed experts placed across the
tensor-parallel ranks, whole, and each sparse layer's tokens sent to the ranks that hold their experts and back.

Placement: of E experts over N ranks, rank r holds experts [r E/N, (r+1) E/N), contiguous, so that a step's pairs
sorted by expert are already grouped by the rank they go to, in rank order. Each rank reads only its experts'
tensors from the checkpoint (`expert_reads`). The router, the shared expert and its gate are replicated; attention
and dense layers stay tensor-parallel (model/parallel.py).

A sparse layer's step (`ExpertParallelMoeBlock.forward`), on every rank of the group; attention's all-reduces have
left each rank the whole [tokens, hidden]:
1. the rank takes its slice of the tokens (rows [r c, (r+1) c), c = ceil(tokens / N), maybe none) and routes them;
2. all-gather of each rank's pairs per expert [E]: every rank then knows what it sends each rank, what it receives
   from each and for which of its experts, and the step's whole load per expert (which the block counts);
3. dispatch: `all_to_all_single` of the pairs' input rows, sorted by expert;
4. each of its experts runs once over the rows it received from every rank (from rank 0 first, each rank's in
   token order: the rows in the order the unsplit layer gives that expert);
5. combine: `all_to_all_single` back, with the reverse splits; the rank scales the results by their routing weights
   and adds them into its tokens' rows in ascending expert order, as the unsplit layer does (`moe.combine`);
6. all-gather of the slices: every rank holds the whole layer output again, as after a row-parallel all-reduce.
gloo has no list-form all-to-all; its `all_to_all_single` (uneven and empty splits included) is what 3 and 5 use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pagoda.config import ModelConfig
from pagoda.model.moe import SparseMoeBlock, combine, run_experts, sort_pairs
from pagoda.model.parallel import ShardError, TensorParallel

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels

# A checkpoint tensor of one routed expert (Mixtral's block_sparse_moe, Qwen's mlp), with its expert's number.
_EXPERT_TENSOR = re.compile(r"(?:model\.)?layers\.\d+\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts rank `rank` of `size` holds: `per_rank` of them, from `first`."""

    rank: int
    size: int
    num_experts: int

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def held(self) -> range:
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)


def check_experts_divisible(num_experts: int, size: int) -> None:
    if num_experts % size:
        raise ShardError(f"enable_expert_parallel cannot place this model's experts: num_experts {num_experts} is "
                         f"not a multiple of tensor_parallel_size {size}")


def expert_placement(config: ModelConfig, parallel: TensorParallel | None) -> ExpertPlacement | None:
    """This rank's experts, when expert parallelism places them (`config`: the whole model's)."""
    if config.moe is None or parallel is None or not parallel.expert_parallel:
        return None
    check_experts_divisible(config.moe.num_experts, parallel.world_size)
    return ExpertPlacement(parallel.rank, parallel.world_size, config.moe.num_experts)


def expert_reads(hf_name: str, placement: ExpertPlacement) -> bool:
    """Whether this rank reads checkpoint tensor `hf_name`: another rank's expert it does not."""
    match = _EXPERT_TENSOR.match(hf_name)
    return match is None or int(match.group(1)) in placement.held


class ExpertParallelMoeBlock(SparseMoeBlock):
    """A sparse layer whose experts are placed across the ranks: the rank's own experts, and the exchange."""

    def __init__(self, config: ModelConfig, kernels: CpuKernels | None, parallel: TensorParallel) -> None:
        assert config.moe is not None
        self.placement = ExpertPlacement(parallel.rank, parallel.world_size, config.moe.num_experts)
        super().__init__(config, kernels, experts_held=self.placement.per_rank)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, per_rank = self.placement.size, self.placement.per_rank
        chunk = -(-x.shape[0] // size)
        local = x[self.placement.rank * chunk:(self.placement.rank + 1) * chunk]
        weights, experts = self.gate.route(local)
        pairs = sort_pairs(weights, experts, self.num_experts)
        # [rank, expert]: the pairs each rank routes to each expert.
        every_rank = self.parallel.gather_columns(pairs.counts[None]).view(size, self.num_experts)
        self.count(every_rank.sum(dim=0))
        held = every_rank[:, self.placement.held.start:self.placement.held.stop]  # [from rank, held expert]
        sent = pairs.counts.view(size, per_rank).sum(dim=1).tolist()
        received = held.sum(dim=1).tolist()
        rows = local.index_select(0, pairs.tokens)
        inbox = rows.new_empty(sum(received), rows.shape[1])
        dist.all_to_all_single(inbox, rows, received, sent, group=self.parallel.group)
        outbox = self._run_held_experts(inbox, held)
        results = torch.empty_like(rows)
        dist.all_to_all_single(results, outbox, sent, received, group=self.parallel.group)
        out = self.add_shared_expert(local, combine(local, pairs, results, pairs.counts.tolist()))
        return self._gather_slices(out, chunk, x.shape[0])

    def _run_held_experts(self, inbox: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """The received rows (by sending rank, then by expert) through this rank's experts, each expert once over
        all of its rows; the results in the order the rows came."""
        expert_of_row = torch.repeat_interleave(torch.arange(self.placement.per_rank).repeat(self.placement.size),
                                                held.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        results = torch.empty_like(inbox)
        results[order] = run_experts(self.experts, inbox[order], held.sum(dim=0).tolist())
        return results

    def _gather_slices(self, out: torch.Tensor, chunk: int, num_tokens: int) -> torch.Tensor:
        """Every rank's slice of the output, in rank order: the whole [num_tokens, hidden] (slices padded to
        `chunk` rows, as gloo's all-gather takes equal sizes)."""
        padded = out.new_zeros(chunk, out.shape[1])
        padded[:out.shape[0]] = out
        slices = [torch.empty_like(padded) for _ in range(self.placement.size)]
        dist.all_gather(slices, padded, group=self.parallel.group)
        return torch.cat(slices)[:num_tokens]
