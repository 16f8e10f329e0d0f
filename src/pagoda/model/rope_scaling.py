"""Rotary position tables for every rope type pagoda loads: default, linear, llama3, yarn, dynamic (NTK) and
longrope, over the whole head or its first `rotary_dim` dims (partial rotary).

Each follows `transformers`' frequencies step for step, in fp32. Two of them change with the sequence's length
in `transformers` (dynamic and longrope recompute the frequencies of a whole forward from its longest position);
here every position keeps one rotation whatever the sequence around it, so that a block's KV does not depend on
when it was computed (the prefix cache shares it). Each position gets the frequencies `transformers` gives it when
it decodes that position one token at a time: below the threshold (`max_position_embeddings` for dynamic,
`original_max_position_embeddings` for longrope) the unscaled (short) set, from it on the scaled (long) one,
as vLLM does. A prompt longer than the threshold, prefilled in one forward, is thus rotated as `transformers`
rotates it only past the threshold.

Partial rotary: `transformers` rotates dims [0, rotary_dim) of a head in halves and passes the rest through.
pagoda's attention rotates whole heads in halves, so the loader reorders each head's q and k rows
(`partial_rotary_order`): the rotated half-pairs keep their pairing, the passed-through dims are paired with each
other at cos 1 and sin 0, and q·k is unchanged (the same reorder on both sides of the dot product).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """The order of a head's dims that puts rotated dim i and i + rotary_dim/2 at j and j + head_dim/2, and the
    passed-through dims after them in each half: row j of the reordered head is row order[j] of the original."""
    rotated, passed = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(rotated)) + list(range(rotary_dim, rotary_dim + passed))
    second = list(range(rotated, rotary_dim)) + list(range(rotary_dim + passed, head_dim))
    return first + second


def _base_inverse_frequencies(dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor: float = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Interpolated (divided by factor) below the correction range, extrapolated (kept) above, a linear ramp
    between; cos and sin scaled by the attention factor."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope_attention_factor(scaling: dict[str, Any]) -> float:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None,
                        max_positions: int) -> tuple[torch.Tensor, float]:
    """([max_positions, dim/2] or [dim/2] inverse frequencies, the factor cos and sin are scaled by)."""
    rope_type = "default" if scaling is None else scaling["rope_type"]
    inv_freq = _base_inverse_frequencies(dim, theta)
    if scaling is None or rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(dim, theta, scaling)
    if rope_type == "dynamic":
        # From max_position_embeddings on, each position p has the base transformers computes for a
        # sequence of p + 1 tokens (its arithmetic, in fp32 tensors, as there).
        threshold, factor = scaling["max_position_embeddings"], scaling["factor"]
        per_position = inv_freq.expand(max_positions, -1).clone()
        if max_positions > threshold:
            seq_len = torch.arange(threshold + 1, max_positions + 1)
            base = theta * ((factor * seq_len / threshold) - (factor - 1)) ** (dim / (dim - 2))
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            per_position[threshold:] = 1.0 / (base[:, None] ** exponents[None, :])
        return per_position, 1.0
    if rope_type == "longrope":
        threshold = scaling["original_max_position_embeddings"]
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        short, long = (1.0 / (torch.tensor(scaling[name], dtype=torch.float32) * theta**exponents)
                       for name in ("short_factor", "long_factor"))
        per_position = short.expand(max_positions, -1).clone()
        per_position[threshold:] = long
        return per_position, _longrope_attention_factor(scaling)
    raise ValueError(f"rope type {rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}")


def rope_tables(head_dim: int, rotary_dim: int, max_positions: int, theta: float,
                scaling: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] in fp32, halves repeated (HF's layout), on the default device. With
    rotary_dim < head_dim, in `partial_rotary_order`'s layout: the passed-through dims at cos 1, sin 0."""
    inv_freq, attention_factor = inverse_frequencies(rotary_dim, theta, scaling, max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    freqs = positions * (inv_freq if inv_freq.dim() == 2 else inv_freq[None, :])
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    if rotary_dim < head_dim:
        passed = head_dim // 2 - rotary_dim // 2
        cos = torch.cat((cos, torch.ones(max_positions, passed)), dim=-1)
        sin = torch.cat((sin, torch.zeros(max_positions, passed)), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
