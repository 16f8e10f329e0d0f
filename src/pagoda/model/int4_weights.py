"""The one in-memory form of a 4-bit weight, whatever produced it (pagoda's own quantizer, or a GPTQ or AWQ
checkpoint unpacked at load): integer codes with per-group scales and zero points.

    W[o, i] = (codes[o, i] - zero[o, g(i)]) * scale[o, g(i)]

where g(i) = i // group_size, or g_idx[i] when the checkpoint reorders columns (GPTQ's act-order). A ragged
last group (group_size not dividing the input width) simply holds the remaining columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Int4Weights:
    codes: torch.Tensor  # uint8 [out_features, in_features], each in 0..15
    scales: torch.Tensor  # fp32 [out_features, num_groups]
    zeros: torch.Tensor | None  # fp32 [out_features, num_groups] in code units; None: symmetric (zero point 8)
    group_size: int
    g_idx: torch.Tensor | None = None  # int64 [in_features]: each column's group, when not i // group_size

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the codes stand for (the reference every path is checked against)."""
        groups = self.g_idx if self.g_idx is not None else torch.arange(self.in_features) // self.group_size
        scale = self.scales[:, groups]
        zero = 8.0 if self.zeros is None else self.zeros[:, groups]
        return (self.codes.float() - zero) * scale


def stack_outputs(parts: list[Int4Weights]) -> Int4Weights:
    """One layer from several stacked along the output dimension (q, k, v into qkv): they must share group
    size, symmetry and column order (GPTQ act-order orders the columns of layers with the same input alike)."""
    first = parts[0]
    for part in parts[1:]:
        if part.group_size != first.group_size or (part.zeros is None) != (first.zeros is None):
            raise ValueError("4-bit layers fused into one must share group size and zero points")
        if (part.g_idx is None) != (first.g_idx is None) or (
            part.g_idx is not None and first.g_idx is not None and not torch.equal(part.g_idx, first.g_idx)
        ):
            raise ValueError("4-bit layers fused into one (q/k/v, gate/up) must share g_idx (column order)")
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts if p.zeros is not None])
    return Int4Weights(codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       zeros=zeros, group_size=first.group_size, g_idx=first.g_idx)
