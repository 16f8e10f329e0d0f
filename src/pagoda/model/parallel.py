"""Tensor parallelism, Megatron-style: what one rank holds of each weight, and the layers that join the ranks.

A rank's model is the architecture cut to its share (`shard_config`): its q heads, its KV heads (num_kv_heads / N
of them; with fewer KV heads than ranks, the one its q heads use, so that each KV head is replicated on
N / num_kv_heads ranks), its slice of the MLP's intermediate width and of the vocabulary. q/k/v and gate/up are
column-parallel (each rank computes its own heads and columns, no communication); o and down are row-parallel
(`RowParallelLinear`: partial sums, one all-reduce); the embedding is vocabulary-parallel
(`VocabParallelEmbedding`: a masked lookup and an all-reduce) and so is the LM head (each rank's logits, gathered
along the vocabulary before sampling). Norms are replicated. `shard_rows` says which slice of a checkpoint tensor
a rank reads, so that each rank reads only its own bytes.

The collectives run on the rank's tensor-parallel group (torch.distributed's default group without pipeline
stages), which the executor sets up; where its ranks share a machine, the all-reduces that fit go through shared
memory instead (model/shm_all_reduce.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.model.shm_all_reduce import SharedMemoryAllReduce
from pagoda.model_dir import ModelLoadError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among the ranks one model is split across: its rank and their number in its
    tensor-parallel group (with pipeline stages, the group of its stage's ranks; None: the default group), and
    whether a mixture of experts' experts are placed across the same ranks (model/expert_parallel.py)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False
    # Where every rank is on one machine: the shared-memory sum for what fits it (model/shm_all_reduce.py).
    local: SharedMemoryAllReduce | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.local is not None and self.local.takes(tensor):
            return self.local(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def max_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks, in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each rank's [rows, columns] side by side, in rank order: [rows, world_size * columns]."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class ShardError(ModelLoadError):
    """The model cannot be split across this many ranks."""


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Refuses a split that leaves ranks unequal shares (the vocabulary is not padded)."""
    kv_heads = config.num_kv_heads
    problems = [f"{name} {value} is not a multiple of {world_size}" for name, value in (
        ("num_attention_heads", config.num_heads), ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size)) if value % world_size]
    if kv_heads % world_size and world_size % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} neither divides nor is a multiple of {world_size}")
    if problems:
        raise ShardError(f"tensor_parallel_size {world_size} cannot split this model: {'; '.join(problems)}")


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """The KV heads one rank holds: its share, or one (replicated) when the ranks outnumber them."""
    return max(1, num_kv_heads // world_size)


def shard_config(config: ModelConfig, parallel: TensorParallel) -> ModelConfig:
    """The architecture of one rank's share: its heads, KV heads, intermediate width and vocabulary slice."""
    size = parallel.world_size
    check_divisible(config, size)
    if config.qk_norm and not config.qk_norm_per_head:
        raise ShardError(f"tensor_parallel_size {size} cannot split {config.architecture}: its q/k norms span every "
                         "head of the projection")
    return replace(config, num_heads=config.num_heads // size,
                   num_kv_heads=kv_heads_per_rank(config.num_kv_heads, size),
                   intermediate_size=config.intermediate_size // size, vocab_size=config.vocab_size // size)


def first_kv_head(config: ModelConfig, parallel: TensorParallel) -> int:
    """The first (full-model) KV head this rank holds; with fewer KV heads than ranks, the one its q heads use."""
    if config.num_kv_heads >= parallel.world_size:
        return parallel.rank * (config.num_kv_heads // parallel.world_size)
    return parallel.rank * config.num_kv_heads // parallel.world_size


_LAYER_TENSOR = re.compile(r"(?:model\.)?layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)")


def shard_rows(hf_name: str, config: ModelConfig, parallel: TensorParallel) -> tuple[int, int, int] | None:
    """The slice of checkpoint tensor `hf_name` this rank holds: (dimension, start, stop), or None when every
    rank holds all of it (norms, and the biases of o and down, which are added once, after the all-reduce).
    `config` is the full model's."""
    size, rank = parallel.world_size, parallel.rank
    name = hf_name.removeprefix("model.")
    if name in ("embed_tokens.weight", "lm_head.weight"):
        rows = config.vocab_size // size
        return 0, rank * rows, (rank + 1) * rows
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None:
        return None
    _, which, kind = match.groups()
    if which in ("qkv", "gate_up"):  # fused in the checkpoint (Phi-3): read whole, split and sliced on the way in
        return None
    head_dim = config.head_dim
    if which == "q":
        rows = config.num_heads // size * head_dim
        return 0, rank * rows, (rank + 1) * rows
    if which in ("k", "v"):
        start = first_kv_head(config, parallel) * head_dim
        return 0, start, start + kv_heads_per_rank(config.num_kv_heads, size) * head_dim
    if which in ("gate", "up"):
        rows = config.intermediate_size // size
        return 0, rank * rows, (rank + 1) * rows
    columns = (config.num_heads * head_dim if which == "o" else config.intermediate_size) // size
    return None if kind == "bias" else (1, rank * columns, (rank + 1) * columns)


# The projections whose input features are split across ranks: a LoRA delta's shrink is a partial sum there.
ROW_PARALLEL_PROJECTIONS = ("o_proj", "down_proj")


def shard_lora_module(module: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig,
                      parallel: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a LoRA module's A [rank, in] and B [out, rank] (`config`: the full model's). A
    column-parallel projection (q/k/v, gate/up, and Phi-3's fused forms) keeps A whole and its own rows of B, as
    `shard_rows` gives the base weight's; a row-parallel one (o, down) keeps its columns of A and B whole, so each
    rank's x A^T is a partial sum that the ranks add up before B."""
    size, rank, head_dim = parallel.world_size, parallel.rank, config.head_dim
    if module in ROW_PARALLEL_PROJECTIONS:
        columns = a.shape[1] // size
        return a[:, rank * columns:(rank + 1) * columns], b
    q_full, kv_full = config.num_heads * head_dim, config.num_kv_heads * head_dim
    q_rows, inter_rows = q_full // size, config.intermediate_size // size
    kv_start = first_kv_head(config, parallel) * head_dim
    kv_rows = kv_heads_per_rank(config.num_kv_heads, size) * head_dim
    q, k = (rank * q_rows, q_rows), (kv_start, kv_rows)
    gate = (rank * inter_rows, inter_rows)
    spans = {"q_proj": [q], "k_proj": [k], "v_proj": [k],
             "qkv_proj": [q, (q_full + kv_start, kv_rows), (q_full + kv_full + kv_start, kv_rows)],
             "gate_proj": [gate], "up_proj": [gate],
             "gate_up_proj": [gate, (config.intermediate_size + gate[0], inter_rows)]}[module]
    return a, torch.cat([b[start:start + rows] for start, rows in spans])


class RowParallelLinear(nn.Linear):
    """A linear whose input features are split across the ranks: each computes a partial sum of every output,
    one all-reduce adds them up, and the bias (held whole by every rank) is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out.add_(self.bias)


class QuantizedRowParallel(nn.Module):
    """A row-parallel linear whose shard runs a quantized layer (`quantization.prepare_linears`, or a GPTQ/AWQ
    checkpoint's codes): the shard's partial sums in the activations' dtype, one all-reduce, then the bias once.
    `local` holds no bias; the bias is the whole one, as `RowParallelLinear`'s."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, parallel: TensorParallel) -> None:
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(self.local(x))
        return out if self.bias is None else out.add_(self.bias.to(out.dtype))


def local_share(linear: RowParallelLinear) -> nn.Linear:
    """The shard's weight as a plain linear without bias (a view: no copy), for a quantizer to replace."""
    local = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    local.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
    return local


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding. A token outside them looks up zeros; the all-reduce then gives every
    rank the row of whichever rank holds it (adding zeros is exact, so the result is the unsplit lookup's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: TensorParallel) -> None:
        super().__init__(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
        self.parallel = parallel
        self.vocab_start = parallel.rank * num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(rows.masked_fill_(outside[:, None], 0))
