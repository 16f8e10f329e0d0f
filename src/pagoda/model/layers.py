"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

Numerics follow Hugging Face `transformers` step for step (fp32 norm statistics, cos/sin computed in
fp32 then cast), because greedy output must equal it token for token.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.parallel import RowParallelLinear, TensorParallel

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels  # pagoda's CPU kernels, if the model runs them: the add and the norm in one call

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x), after adding `delta` into x in place when given (x is the residual stream)."""
        if self.kernels is not None and x.is_contiguous():
            return self.kernels.add_rms_norm_(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        # HF's x * rsqrt(mean(x^2) + eps) in fp32, as one fused op instead of five.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return torch.mul(self.weight, normed.to(x.dtype))


def row_linear(in_features: int, out_features: int, bias: bool, parallel: TensorParallel | None) -> nn.Linear:
    """A linear whose input is this rank's share of the features: across ranks, row-parallel (one all-reduce)."""
    if parallel is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor: float = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (non-interleaved halves, as HF), in fp32
    whatever the model's dtype."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        if torch.empty(0).device.type == "meta":
            # Shapes only, until `recompute`. Arithmetic on the meta device imports torch's symbolic-shape
            # machinery (sympy), which stays resident: ~70 MB, six times the built-in model.
            cos = sin = torch.empty(max_positions, head_dim)
        else:
            cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed on the default device (on the meta device, only their shapes)."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def recompute(self, device: str | torch.device) -> None:
        """Computes the tables again and moves them to `device`: for a model built on the meta device, once
        it is allocated (allocation leaves them empty, and casting the model to its dtype rounds them)."""
        cos, sin = self._tables()
        self.cos, self.sin = cos.to(device), sin.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] tables for the batch, built once per step for all layers."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, kernels: CpuKernels | None = None,
                 parallel: TensorParallel | None = None) -> None:
        """intermediate_size: this rank's share of it; parallel: the ranks down's partial sums are added across."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, parallel)
        self.kernels = kernels  # pagoda's CPU kernels, if the model runs them: the gate in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            gated = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            gated = F.silu(gate) * up
        out: torch.Tensor = self.down_proj(gated)
        return out
