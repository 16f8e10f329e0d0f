"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP.

Numerics follow Hugging Face `transformers` step for step (fp32 norm statistics, cos/sin computed in
fp32 then cast), because greedy output must equal it token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.parallel import RowParallelLinear, TensorParallel
from pagoda.model.rope_scaling import rope_tables

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, kernels: CpuKernels | None = None, unit_offset: bool = False,
                 scale_in_fp32: bool = False) -> None:
        """unit_offset: the scale is (1 + weight), applied in fp32 (Gemma); scale_in_fp32: the weight multiplies
        the fp32 normalized value before it is cast back (OLMo 2, Gemma), not after (Llama). Either runs the
        torch path in a low-precision dtype, where the fused kernel would round differently; in fp32 the kernel
        scales by the weight, or by (1 + weight) summed in fp32."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_in_fp32 = scale_in_fp32 or unit_offset
        # pagoda's CPU kernels, if the model runs them: the add and the norm in one call.
        self.kernels = kernels

    def scale(self) -> torch.Tensor:
        """What the normalized value is multiplied by: the weight, or (1 + weight) summed in fp32 (unit_offset).
        The native decode stack takes it from here, so that its products are this module's."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x), after adding `delta` into x in place when given (x is the residual stream)."""
        scale = self.scale()
        fp32_exact = not self.scale_in_fp32 or x.dtype == torch.float32
        if self.kernels is not None and x.is_contiguous() and fp32_exact:
            return self.kernels.add_rms_norm_(x, delta, scale, self.eps)
        if delta is not None:
            x.add_(delta)
        # HF's x * rsqrt(mean(x^2) + eps) in fp32, as one fused op instead of five.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.scale_in_fp32:
            return (scale * normed).to(x.dtype)
        return torch.mul(scale, normed.to(x.dtype))


def row_linear(in_features: int, out_features: int, bias: bool, parallel: TensorParallel | None) -> nn.Linear:
    """A linear whose input is this rank's share of the features: across ranks, row-parallel (one all-reduce)."""
    if parallel is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (non-interleaved halves, as HF), in fp32
    whatever the model's dtype (model/rope_scaling.py computes them; with rotary_dim < head_dim, in its layout)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
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
        return rope_tables(self.head_dim, self.rotary_dim, self.max_positions, self.theta, self.scaling)

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
    """A gated MLP, SwiGLU (silu) or GeGLU (gelu_pytorch_tanh), with the gate and up projections fused into one
    matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, kernels: CpuKernels | None = None,
                 parallel: TensorParallel | None = None, activation: str = "silu") -> None:
        """intermediate_size: this rank's share of it; parallel: the ranks down's partial sums are added across."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, parallel)
        # pagoda's CPU kernels, if the model runs them: the SiLU gate in one call.
        self.kernels = kernels if activation == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            gated = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            if self.activation == "silu":
                gated = F.silu(gate) * up
            else:
                gated = F.gelu(gate, approximate="tanh") * up
        out: torch.Tensor = self.down_proj(gated)
        return out
