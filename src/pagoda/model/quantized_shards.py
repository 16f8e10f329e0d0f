"""Quantized weights split across tensor-parallel ranks: what each rank reads of a GPTQ/AWQ checkpoint's packed
tensors, and which splits 4-bit groups allow.

Load-time quantization (`--quantization int8|int4`) shards first and quantizes each rank's shard
(`quantization.prepare_linears`); so do GPTQ/AWQ checkpoints, whose packed codes, scales and zero points each rank
reads its slice of. Either way a rank's codes and scales are the unsplit model's, sliced:

- column-parallel linears (q/k/v, gate/up, the LM head: output rows split) quantize each output row on its own
  (int8 per row, int4 per row and group), so the shard's rows are the whole layer's rows;
- row-parallel linears (o, down: input columns split): int8 scales each row by the whole row's largest |weight|,
  all-reduced at load; int4 and GPTQ/AWQ groups must then lie within one rank's columns, so a split that is not a
  multiple of the group size is refused (`check_row_groups`).

The partial sums of a row-parallel shard are then exactly its columns' share of the unsplit layer's, added by the
all-reduce: the same result up to summation order.

The packed layouts (model/prequantized.py) decide which slice of each part a rank reads. With `s..e` the rank's
output rows (column-parallel) or input columns (row-parallel) and g the group size:

    part      GPTQ layout       column-parallel        AWQ layout        column-parallel
    qweight   [in / 8, out]     [:, s:e]               [in, out / 8]     [:, s/8:e/8]
    qzeros    [groups, out / 8] [:, s/8:e/8]           [groups, out / 8] [:, s/8:e/8]
    scales    [groups, out]     [:, s:e]               [groups, out]     [:, s:e]
    g_idx     [in]              whole                  -

    row-parallel: GPTQ qweight [s/8:e/8], AWQ qweight [s:e]; both qzeros and scales [s/g:e/g]; g_idx [s:e], its
    group numbers less s/g (`rebase_g_idx`).

GPTQ act-order (desc_act: g_idx shuffles which columns form a group) is refused when split: a rank's columns would
need groups that other ranks' columns share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import torch

from pagoda.config import ModelConfig
from pagoda.int4_format import Int4Options
from pagoda.model.parallel import ShardError, TensorParallel, shard_rows
from pagoda.model.prequantized import CODES_PER_WORD, PrequantizedFormat, read_prequantized_format
from pagoda.model_dir import read_json

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
Slicer = Callable[[str], "tuple[int, int, int] | None"]  # loader.TensorSlicer


def row_parallel_widths(config: ModelConfig, parallel: TensorParallel) -> dict[str, int]:
    """The input width of each row-parallel linear's shard (`config`: the whole model's): o_proj always, down_proj
    where some layer has a dense MLP (a mixture of experts' experts are whole on their rank)."""
    from pagoda.model.moe import is_sparse_layer

    widths = {"o_proj": config.num_heads * config.head_dim // parallel.world_size}
    if any(not is_sparse_layer(config, layer) for layer in range(config.num_layers)):
        widths["down_proj"] = config.intermediate_size // parallel.world_size
    return widths


def check_row_groups(config: ModelConfig, parallel: TensorParallel, group_size: int, what: str) -> None:
    """Refuses a split whose row-parallel shards cut a 4-bit group (`what`: whose groups, for the message)."""
    problems = [f"{name}'s {width} input columns a rank" for name, width in
                row_parallel_widths(config, parallel).items() if width % group_size]
    if problems:
        raise ShardError(f"tensor_parallel_size {parallel.world_size} cannot split {what} of group size "
                         f"{group_size}: a rank's share of a row-parallel layer must be whole groups, and "
                         f"{', '.join(problems)} are not a multiple of {group_size} (a smaller group size, or "
                         "fewer ranks, splits it)")


def check_prequantized_split(config: ModelConfig, parallel: TensorParallel, fmt: PrequantizedFormat) -> None:
    """What a split GPTQ/AWQ checkpoint needs: groups within a rank's columns, no act-order, and output slices on
    the eight-column words the zero points are packed in."""
    what = f"this {fmt.method} checkpoint"
    if fmt.desc_act:
        raise ShardError(f"tensor_parallel_size {parallel.world_size} cannot split {what}: it is act-order "
                         "(desc_act), whose groups gather columns from every rank's share; split only by "
                         "pipeline_parallel_size, or use a checkpoint quantized without desc_act")
    if fmt.group_size == -1:
        raise ShardError(f"tensor_parallel_size {parallel.world_size} cannot split {what}: its group_size -1 "
                         "makes one group of each whole input row, which the row-parallel layers split")
    check_row_groups(config, parallel, fmt.group_size, what)
    size = parallel.world_size
    outputs = {"q_proj": config.num_heads // size * config.head_dim, "k_proj/v_proj": config.head_dim,
               "gate_proj/up_proj": config.intermediate_size // size}  # k/v: a rank's start is a head's
    if fmt.lm_head:
        outputs["lm_head"] = config.vocab_size // size
    ragged = [f"{name} ({width})" for name, width in outputs.items() if width % CODES_PER_WORD]
    if ragged:
        raise ShardError(f"tensor_parallel_size {size} cannot split {what}: a rank's output columns of "
                         f"{', '.join(ragged)} are not whole {CODES_PER_WORD}-column words of its packed zero points")


def shard_prequantized(hf_name: str, config: ModelConfig, parallel: TensorParallel,
                       fmt: PrequantizedFormat) -> tuple[int, int, int] | None:
    """The slice of checkpoint tensor `hf_name` this rank reads: a packed part's by the table above, anything
    else's by `shard_rows`."""
    prefix, _, part = hf_name.rpartition(".")
    if part not in _PARTS:
        return shard_rows(hf_name, config, parallel)
    split = shard_rows(f"{prefix}.weight", config, parallel)
    if split is None:
        return None
    dim, start, stop = split
    word, group = CODES_PER_WORD, fmt.group_size
    if dim == 0:  # output rows: the columns of every packed part
        if part == "g_idx":
            return None
        packed = part == "qzeros" or (part == "qweight" and fmt.method == "awq")
        return (1, start // word, stop // word) if packed else (1, start, stop)
    if part == "qweight":  # input columns: the rows of every part
        return (0, start // word, stop // word) if fmt.method == "gptq" else (0, start, stop)
    if part == "g_idx":
        return 0, start, stop
    return 0, start // group, stop // group


def rebase_g_idx(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, parallel: TensorParallel,
                 fmt: PrequantizedFormat) -> Iterator[tuple[str, torch.Tensor]]:
    """A row-parallel shard's g_idx numbers its groups from the rank's first: the whole layer's numbers less the
    groups of the ranks before (its scales and zero points are read from that group on)."""
    for name, tensor in weights:
        split = shard_rows(f"{name.removesuffix('.g_idx')}.weight", config, parallel) \
            if name.endswith(".g_idx") else None
        if split is not None and split[0] == 1:
            tensor = tensor - split[1] // fmt.group_size
        yield name, tensor


def check_quantized_split(model_dir: str | Path, config: ModelConfig, tensor_parallel_size: int,
                          quantization: str | None, options: Int4Options | None) -> None:
    """Refuses, before any rank starts, a quantized model that tensor_parallel_size ranks cannot split."""
    prequantized = read_prequantized_format(read_json(Path(model_dir) / "config.json"), model_dir)
    if tensor_parallel_size > 1 and (quantization is not None or prequantized is not None):
        quantized_slicer(config, TensorParallel(0, tensor_parallel_size), quantization, options, prequantized)


def quantized_slicer(config: ModelConfig, parallel: TensorParallel, quantization: str | None,
                     options: Int4Options | None, prequantized: PrequantizedFormat | None) -> Slicer | None:
    """A quantized model's split, checked: a GPTQ/AWQ checkpoint's slicer for its packed parts, or None when
    the plain one (`shard_rows`) reads what load-time quantization quantizes."""
    if prequantized is not None:
        check_prequantized_split(config, parallel, prequantized)
        return partial(shard_prequantized, config=config, parallel=parallel, fmt=prequantized)
    if quantization == "int4":
        check_row_groups(config, parallel, (options or Int4Options()).group_size, "int4 weights")
    return None
