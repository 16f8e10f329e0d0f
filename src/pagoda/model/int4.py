"""4-bit weight-only linear layers (W4A16): pagoda's own group-wise quantizer and the layer that runs the codes.

Storage is half a byte per weight in torch's CPU int4 layout (`pack_int4`), plus one
bf16 (scale, offset) pair per group of input columns (`pagoda.int4_format`, `pack_group_pairs`): W = (q - 8) * scale +
offset, q in 0..15.
Every source of 4-bit weights (this module's quantizer, GPTQ and AWQ checkpoints) arrives as `Int4Weights` and is
converted once, so there is one runtime form and one set of numerics.

Where the model was given pagoda's int4 kernel (kernels/cpu_int4.cpp: an AVX-512 form in the full set, an
AVX2 one beside it), inputs up to the module's `matmul_int4_max_rows` run it (the AVX-512 form: any number; the
AVX2 one: 512): x quantized per group to int8, as llama.cpp does, and integer products summed from the packed
nibbles in place. At one row it runs 2.7-4x torch's int4 matmul on bench-1b's shapes; the AVX2 form outruns
dequantized fp32 GEMMs up to a few hundred rows, and longer prefill chunks go to the tiles described next.
Without it, decode-sized inputs
(up to `MATMUL_MAX_ROWS` rows) run torch's int4 matmul, which takes bf16 activations (its fp32 path is
scalar and an order of magnitude slower), so fp32 models round x to bf16 for these layers; larger inputs
are matrix multiplications: the weight is dequantized to the input's dtype, from the same packed codes and
the same bf16 scales, a slice of rows at a time into a cache-sized tile (one whole fp32 weight a call costs
more in page faults than in arithmetic), and each tile goes to torch's GEMM. Every path uses identical
weights; they differ only in how x is rounded and summed.

torch's layout interleaves output rows in blocks whose size depends on the CPU torch was built to run on (32
rows, or 64 on AVX-512 hosts); pagoda's kernel reads 32-row blocks on every host, so a layer packs its codes
itself, in 32-row blocks for the kernel and in torch's block for torch's matmul. The pairs follow the same
choice: block-major for the kernel (a block's pairs stream beside its codes), torch's [groups, out] otherwise.

Shapes the int4 kernel cannot take are padded at construction, never at the caller: output rows up to a
multiple of the layout's block, input columns up to a multiple of the group size (a ragged last group
keeps its own statistics, from its real columns only; padded columns meet zero activations).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.int4_format import Int4Options
from pagoda.model.int4_weights import Int4Weights
from pagoda.model.tiled_matmul import gemm_dtype, tiled_matmul

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import QuantizedKernels

# Group sizes torch's int4 kernel takes; a checkpoint group that is a multiple of one is split into
# kernel groups that repeat its scale (exact).
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
BLOCK_ROWS = 32  # pagoda's kernel reads output rows interleaved in blocks of this many
# Without pagoda's kernel: up to this many rows torch's int4 matmul beats dequantized tiles into a GEMM (it
# re-reads the nibbles per few rows; 0.8x the tiles' time at 64 rows, 1.05x at 128, bench-1b gate/up, Zen 3).
MATMUL_MAX_ROWS = 64


# --- quantizer ---------------------------------------------------------------------------------------------

# Candidate clipping ranges, as fractions of each group's [min, max] (1.0 = no clipping).
_CLIP_FRACTIONS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.8, 0.75)
_ROWS_PER_PASS = 256  # rows quantized together: the candidates' passes over them stay in cache


def quantize_int4(weight: torch.Tensor, options: Int4Options) -> Int4Weights:
    """Group-wise round-to-nearest of a [out, in] weight; per group, the clipping range with the least squared
    error among `_CLIP_FRACTIONS` of its full range when `options.search`. A ragged last group is padded with
    zeros, which change no group's statistics (every range includes 0)."""
    weight = weight.detach().float()
    out_features, in_features = weight.shape
    g = options.group_size
    num_groups = -(-in_features // g)
    groups = F.pad(weight, (0, num_groups * g - in_features)).view(out_features, num_groups, g)
    parts = [_quantize_groups(rows, options) for rows in torch.split(groups, _ROWS_PER_PASS)]
    codes, scales, zeros = (torch.cat(part) for part in zip(*parts))
    return Int4Weights(codes=codes.view(out_features, -1)[:, :in_features].contiguous(), scales=scales,
                       zeros=None if options.sym else zeros, group_size=g)


def _quantize_groups(groups: torch.Tensor, options: Int4Options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, num_groups, g] -> (uint8 codes, scales, zero points) of the best candidate range per group."""
    best_err = best_scale = best_zero = None
    for fraction in _CLIP_FRACTIONS if options.search else (1.0,):
        scale, zero = _scale_and_zero(groups, fraction, options.sym)
        codes = _codes(groups, scale, zero)
        err = codes.sub_(zero[..., None]).mul_(scale[..., None]).sub_(groups).square_().sum(-1)
        if best_err is None or best_scale is None or best_zero is None:
            best_err, best_scale, best_zero = err, scale, zero
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    assert best_scale is not None and best_zero is not None
    return _codes(groups, best_scale, best_zero).to(torch.uint8), best_scale, best_zero


def _scale_and_zero(groups: torch.Tensor, fraction: float, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: a bf16-representable scale (the stored precision, so the codes are chosen against it) and the
    zero point in code units."""
    if sym:
        scale = (groups.abs().amax(-1) * (fraction / 7.5)).clamp(min=1e-10).bfloat16().float()
        return scale, torch.full_like(scale, 8.0)
    high = groups.amax(-1).clamp(min=0) * fraction
    low = groups.amin(-1).clamp(max=0) * fraction
    scale = ((high - low) / 15).clamp(min=1e-10).bfloat16().float()
    return scale, torch.round(-low / scale).clamp(0, 15)


def _codes(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)


# --- the layer ---------------------------------------------------------------------------------------------


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) with W held as 4-bit codes in torch's CPU int4 layout (`pack_int4`)."""

    packed: torch.Tensor  # uint8 [padded_out, padded_in // 2], torch's int4 layout
    scales_and_zeros: torch.Tensor  # bf16 (scale, offset) per group and row, laid out by `pack_group_pairs`
    input_order: torch.Tensor | None  # int64 [in]: column order that makes the groups contiguous (act-order)

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None,
                 kernels: QuantizedKernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = weights.in_features, weights.out_features
        codes, scales, zeros, group_size, order = _contiguous_groups(weights)
        self.kernel_group = _kernel_group(group_size)
        self.block_rows = BLOCK_ROWS if kernels is not None else torch_int4_block_rows()
        self.pair_block_rows = BLOCK_ROWS if kernels is not None else None  # `pack_group_pairs`'s layout
        self.padded_in = -(-self.in_features // group_size) * group_size
        self.padded_out = -(-self.out_features // self.block_rows) * self.block_rows
        pad_rows, pad_cols = self.padded_out - self.out_features, self.padded_in - self.in_features
        codes = F.pad(codes.to(torch.int32), (0, pad_cols, 0, pad_rows), value=8)
        zeros = torch.full_like(scales, 8.0) if zeros is None else zeros
        offsets = F.pad((8.0 - zeros) * scales, (0, 0, 0, pad_rows))  # padded rows: weight 0
        scales = F.pad(scales, (0, 0, 0, pad_rows))
        repeat = group_size // self.kernel_group  # a checkpoint group spanning several kernel groups
        scales, offsets = scales.repeat_interleave(repeat, dim=1), offsets.repeat_interleave(repeat, dim=1)
        self.register_buffer("packed", pack_int4(codes, self.block_rows))
        self.register_buffer("scales_and_zeros",
                             pack_group_pairs(torch.stack([scales, offsets], dim=-1), self.pair_block_rows))
        self.register_buffer("input_order", order)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))
        if self.kernels is not None and x.shape[0] <= self.kernels.matmul_int4_max_rows:
            y = self.kernels.matmul_int4(x, self.packed, self.kernel_group, self.scales_and_zeros)
        elif self.kernels is None and x.shape[0] <= MATMUL_MAX_ROWS:
            y = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), self.packed, self.kernel_group,
                                                  self.scales_and_zeros).to(x.dtype)
        else:
            scale, base = self._scale_and_base(gemm_dtype(x.dtype))
            y = tiled_matmul(x, self.padded_out, lambda start, end, _: self._dequantize_rows(start, end, scale, base))
        y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @property
    def runs_kernel_unpadded(self) -> bool:
        """Whether a decode input goes straight to the kernel: no column gather, no padding in or out (what the
        native decode stack requires of a layer)."""
        return (self.kernels is not None and self.input_order is None and self.padded_in == self.in_features
                and self.padded_out == self.out_features)

    @property
    def matmul_name(self) -> str:
        """What it runs, for people reading the start-up summary."""
        if self.kernels is None:
            return f"torch's int4 matmul up to {MATMUL_MAX_ROWS} rows, dequantized tiles beyond"
        max_rows = self.kernels.matmul_int4_max_rows
        if max_rows == sys.maxsize:
            return "pagoda's int4 kernel (x as int8)"
        return f"pagoda's int4 kernel up to {max_rows} rows (x as int8), dequantized tiles beyond"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [padded_out, padded_in] (padding included, columns in `input_order`), as the int4 kernel sees it."""
        scale, base = self._scale_and_base(dtype)
        return self._dequantize_rows(0, self.padded_out, scale, base)

    def _scale_and_base(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[out, groups, 1] each: W = q * scale + base, base = offset - 8 * scale."""
        pairs = unpack_group_pairs(self.scales_and_zeros, self.pair_block_rows)
        scale, offset = pairs.float().unbind(-1)  # [out, groups] each
        return scale[..., None].to(dtype), (offset - 8 * scale)[..., None].to(dtype)

    def _dequantize_rows(self, start: int, end: int, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Rows start..end of W (multiples of the layout's block), in scale's dtype."""
        block = self.block_rows
        packed = self.packed.view(self.padded_out // block, self.padded_in, block // 2)[start // block : end // block]
        codes = unpack_int4(packed, end - start, self.padded_in, block).view(end - start, -1, self.kernel_group)
        weight = torch.mul(codes, scale[start:end]).add_(base[start:end])
        return weight.view(end - start, self.padded_in)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.kernel_group}"


def pack_int4(codes: torch.Tensor, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """Codes [rows, cols] (0..15; rows a multiple of block_rows) in torch's CPU int4 layout: blocks of
    block_rows output rows, within a block one input column after another, block_rows / 2 bytes per column,
    byte i holding row i (low nibble) and row i + block_rows / 2 (high)."""
    rows, cols = codes.shape
    halves = codes.to(torch.uint8).view(rows // block_rows, 2, block_rows // 2, cols)
    packed = halves[:, 0] | (halves[:, 1] << 4)  # [blocks, block_rows / 2, cols]
    return packed.permute(0, 2, 1).reshape(rows, cols // 2).contiguous()


def unpack_int4(packed: torch.Tensor, rows: int, cols: int, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """`pack_int4` undone: codes [rows, cols]."""
    nibbles = packed.view(rows // block_rows, cols, block_rows // 2)
    block = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [blocks, cols, block_rows]: rows in order
    return block.permute(0, 2, 1).reshape(rows, cols)


def pack_group_pairs(pairs: torch.Tensor, block_rows: int | None) -> torch.Tensor:
    """(scale, offset) pairs [rows, groups, 2] as bf16, in pagoda's kernel layout [rows / block_rows, groups,
    block_rows, 2] (block_rows given: a block's pairs for consecutive groups side by side) or torch's [groups, rows,
    2] (None)."""
    if block_rows is None:
        return pairs.transpose(0, 1).contiguous().bfloat16()
    rows, groups, _ = pairs.shape
    return pairs.view(rows // block_rows, block_rows, groups, 2).transpose(1, 2).contiguous().bfloat16()


def unpack_group_pairs(packed: torch.Tensor, block_rows: int | None) -> torch.Tensor:
    """`pack_group_pairs` undone: [rows, groups, 2]."""
    if block_rows is None:
        return packed.transpose(0, 1)
    blocks, groups, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * block_rows, groups, 2)


@functools.cache
def torch_int4_block_rows() -> int:
    """The row block of torch's int4 layout on this CPU (its converter packs by the ISA it dispatches to)."""
    probe = torch.zeros(64, 2, dtype=torch.int32)
    probe[32, 0] = 1  # 64-row blocks: the high nibble of byte 0; 32-row blocks: the second block
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    return 64 if int(packed.view(-1)[0]) == 0x10 else BLOCK_ROWS


def _kernel_group(group_size: int) -> int:
    for size in KERNEL_GROUP_SIZES:
        if group_size % size == 0:
            return size
    raise ValueError(f"int4 group size {group_size} is not a multiple of 32; pagoda's int4 layers need one")


def _contiguous_groups(
    weights: Int4Weights,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """(codes, scales, zeros, group_size, input_order) with each group's columns side by side: a checkpoint
    that reorders columns (GPTQ act-order, `g_idx`) has its columns sorted by group, and x gathered the same
    way at run time. Every group but the last must then hold exactly `group_size` columns."""
    if weights.g_idx is None:
        return weights.codes, weights.scales, weights.zeros, weights.group_size, None
    g_idx = weights.g_idx.long()
    order = torch.argsort(g_idx, stable=True)
    expected = torch.arange(weights.in_features) // weights.group_size
    if not torch.equal(g_idx[order], expected):
        raise ValueError("g_idx does not split the columns into groups of group_size; pagoda cannot lay them out")
    return weights.codes[:, order], weights.scales, weights.zeros, weights.group_size, order
