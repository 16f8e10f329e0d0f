"""Checkpoint tensors as the model takes them, for the families that store them otherwise.

- Fused projections (Phi-3: `qkv_proj` and `gate_up_proj`) are split into q/k/v and gate/up, the names every other
  family uses, so that one loader, tensor-parallel sharding and quantization see them alike. Under tensor
  parallelism the fused tensor is read whole (`parallel.shard_rows` leaves it) and each part sliced here.
- Partial rotary (`ModelConfig.rotary_dim`): each head's q and k rows reordered to `rope_scaling`'s layout
  (`partial_rotary_order`), so that rope over whole heads rotates the dims transformers rotates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from pagoda.config import ModelConfig
from pagoda.model.rope_scaling import partial_rotary_order

# name -> the slice of it to read, (dimension, start, stop), or None for the whole tensor (loader.TensorSlicer).
Slicer = Callable[[str], "tuple[int, int, int] | None"]
_FUSED = re.compile(
    r"(?P<prefix>(?:model\.)?layers\.\d+\.)(?P<module>self_attn\.qkv|mlp\.gate_up)_proj\.(?P<kind>weight|bias)")
_ROTATED = re.compile(r"(?:model\.)?layers\.\d+\.self_attn\.(q|k)_proj\.(weight|bias)")


def needs_adapting(config: ModelConfig) -> bool:
    """Whether the checkpoint's tensors are reshaped on the way in (a prequantized checkpoint cannot be)."""
    return config.architecture == "phi3" or config.rotary_dim is not None


def adapt_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig,
                     slicer: Slicer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors with fused projections split (each part then sliced by `slicer`, a tensor-parallel rank's) and
    q/k rows reordered for partial rotary. config: the whole model's."""
    for name, tensor in weights:
        fused = _FUSED.fullmatch(name)
        parts = [(name, tensor)] if fused is None else _split(fused, tensor, config, slicer)
        for part_name, part in parts:
            if config.rotary_dim is not None and _ROTATED.fullmatch(part_name):
                part = rotary_row_order(part, config)
            yield part_name, part


def rotary_row_order(rows: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """q or k output rows (whole heads; a weight, a bias, or a LoRA B) in the model's order: with partial rotary,
    each head's rows reordered as `partial_rotary_order` says; otherwise as they are."""
    if config.rotary_dim is None:
        return rows
    order = torch.tensor(partial_rotary_order(config.head_dim, config.rotary_dim))
    heads = rows.view(-1, config.head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)


def _split(fused: re.Match[str], tensor: torch.Tensor, config: ModelConfig,
           slicer: Slicer | None) -> list[tuple[str, torch.Tensor]]:
    prefix, kind = fused["prefix"], fused["kind"]
    if fused["module"] == "self_attn.qkv":
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        names, sizes = ["q", "k", "v"], [q_size, kv_size, kv_size]
        module = "self_attn"
    else:
        names, sizes = ["gate", "up"], [config.intermediate_size, config.intermediate_size]
        module = "mlp"
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"tensor {prefix}{fused['module']}_proj.{kind} has {tensor.shape[0]} rows, expected "
                         f"{sum(sizes)}")
    parts = []
    for which, part in zip(names, torch.split(tensor, sizes)):
        part_name = f"{prefix}{module}.{which}_proj.{kind}"
        window = None if slicer is None else slicer(part_name)
        if window is not None:
            dim, start, stop = window
            part = part.narrow(dim, start, stop - start)
        parts.append((part_name, part))
    return parts
