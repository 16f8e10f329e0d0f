"""Linear layers for the fast paths: fp32/bf16 weights and int8 weight-only (W8A16) quantization; int4
(W4A16) is `model/int4.py`.

After loading, `prepare_linears` swaps the model's nn.Linear layers for these. Decode-sized inputs
(<= 64 rows; fp32 on the AVX2 target <= 4) go to pagoda's GEMV kernels (kernels/cpu_gemv.cpp; simd_gemv.cpp on
AVX2), which stream weights faster than stock torch (bf16/int8 at about twice its rate, fp32 ~1.5x); larger inputs
(prefill, big batches) are matrix multiplications and go to torch (oneDNN). Without the kernels (or for an input
width the kernels do not take, not a multiple of 32), everything goes to torch: the same arithmetic up to
summation order, slower. (int8's kernel also rounds x to int16 per 128-element block: ~15 bits against
its block's largest, where bf16 activations carry 8.) On CPUs with AVX2 but not that AVX-512 set, int8
layers run the AVX2 integer matmul (kernels/cpu_int8.cpp) instead, up to `INT8_MATMUL_MAX_ROWS` rows, x
quantized to int8 per 32 columns as llama.cpp's q8_0 does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.int4_format import Int4Options
from pagoda.model.int4 import Int4Linear, quantize_int4
from pagoda.model.parallel import QuantizedRowParallel, RowParallelLinear, local_share
from pagoda.model.tiled_matmul import gemm_dtype, tiled_matmul

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels, QuantizedKernels

QUANTIZATIONS = (None, "int8", "int4")
# (linear, is the LM head, int8's row maxima or None: its own) -> the layer that replaces it.
LayerFactory = Callable[[nn.Linear, bool, "torch.Tensor | None"], nn.Module]
# Up to this many rows the AVX-512 GEMV kernels beat torch, weights streamed from memory (their module's
# gemv_max_rows): fp32 1.6-1.8x at 32-64 rows of the bench models' shapes; bf16 1.1-1.3x at 32 rows, at 64 1.16x
# on bench-125m's and 0.96x on bench-1b's (AMX-less Zen 4; oneDNN's bf16 GEMM catches up there). The AVX2
# module's GEMV keeps up with torch's GEMM held to AVX2 further (simd_gemv.h's kGemvMaxRows). Beyond, oneDNN's
# GEMM takes over for fp32/bf16. For int8, torch has no fast path (`_weight_int8pack_mm` is 30x slower with
# fp32 inputs), so prefill-sized inputs dequantize into a GEMM.
KERNEL_MAX_ROWS = 64
# Up to this many rows the AVX2 int8 matmul (no AVX-512) beats dequantized tiles into oneDNN's GEMM: 1.1-2.3x
# at 1-64 rows on the bench models' shapes, 0.8-1.5x at 128 (winning on bench-1b's larger layers), 0.4-0.9x
# at 512 (AVX2 Zen 3).
INT8_MATMUL_MAX_ROWS = 128


def gemv_takes(in_features: int) -> bool:
    """Whether the GEMV kernels take a layer of this input width (K)."""
    return in_features % 32 == 0


def _usable(kernels: CpuKernels | None, linear: nn.Linear) -> CpuKernels | None:
    """The kernel module when it takes this layer's shape, else None."""
    return kernels if kernels is not None and gemv_takes(linear.in_features) else None


class DenseLinear(nn.Module):
    """fp32 or bf16 weights: decode-sized inputs through pagoda's GEMV kernel for that dtype."""

    DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)

    def __init__(self, linear: nn.Linear, kernels: CpuKernels | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        usable = _usable(kernels, linear)
        self.gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.max_rows = KERNEL_MAX_ROWS  # the most rows the GEMV takes
        if usable is not None:
            self.gemv = {torch.float32: usable.gemv_fp32, torch.bfloat16: usable.gemv_bf16}[self.weight.dtype]
            self.max_rows = usable.gemv_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is None or not 0 < x.shape[0] <= self.max_rows:  # (an expert-parallel rank's slice may be empty)
            if gemm_dtype(x.dtype) == x.dtype or x.shape[0] == 0:
                return F.linear(x, self.weight, self.bias)
            y = tiled_matmul(x, self.weight.shape[0], lambda start, end, dtype: self.weight[start:end].to(dtype))
            return y if self.bias is None else y + self.bias
        y = self.gemv(x, self.weight)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8 weights: W ~= q * scale[:, None], q in [-127, 127]."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear, kernels: CpuKernels | None,
                 quantized_kernels: QuantizedKernels | None = None, absmax: torch.Tensor | None = None) -> None:
        """absmax: each output row's largest |weight| to scale by (default: this weight's own); a row-parallel
        shard is given its whole row's (`prepare_linears`), so that its scales and codes are the unsplit layer's."""
        super().__init__()
        weight = linear.weight.detach().float()
        scale = ((weight.abs().amax(dim=1) if absmax is None else absmax) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.kernels = _usable(kernels, linear)
        # Without the full set: the AVX2 integer matmul (x as int8 per 32 columns) up to INT8_MATMUL_MAX_ROWS.
        self.matmul = quantized_kernels.matmul_int8 if quantized_kernels is not None and gemv_takes(
            linear.in_features) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None and x.shape[0] <= INT8_MATMUL_MAX_ROWS:
            y = self.matmul(x, self.qweight, self.scale)
        elif self.kernels is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            y = self.kernels.gemv_int8(x, self.qweight, self.scale)
        elif x.shape[0] <= KERNEL_MAX_ROWS:  # torch's int8 matmul takes bf16 x (an fp32 model's is rounded)
            y = torch._weight_int8pack_mm(x.bfloat16(), self.qweight, self.scale.bfloat16()).to(x.dtype)
        else:  # a matrix multiplication: dequantizing costs little next to it
            y = tiled_matmul(x, self.qweight.shape[0], self._dequantize_rows)
        return y if self.bias is None else y + self.bias

    def _dequantize_rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.mul(self.qweight[start:end], self.scale[start:end, None].to(dtype))

    @property
    def matmul_name(self) -> str:
        """What it runs, for people reading the start-up summary."""
        if self.matmul is not None:
            return f"pagoda's int8 kernel up to {INT8_MATMUL_MAX_ROWS} rows (x as int8), dequantized tiles beyond"
        if self.kernels is not None:
            return f"pagoda's int8 GEMV up to {KERNEL_MAX_ROWS} rows, dequantized tiles beyond"
        return f"torch's int8 matmul up to {KERNEL_MAX_ROWS} rows, dequantized tiles beyond"


def prepare_linears(model: nn.Module, quantization: str | None, kernels: CpuKernels | None,
                    int4: Int4Options | None = None, quantized_kernels: QuantizedKernels | None = None) -> None:
    """Swaps nn.Linear layers (LM head included, unless int4 options leave it out) for the fast path the dtype
    and quantization call for. kernels: the GEMV kernels the model runs (`ModelRuntime.gemv_kernels`), or None.
    int4: the int4 quantizer's options (None: its defaults); quantized_kernels: `ModelRuntime.quantized_kernels`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; choose from {QUANTIZATIONS}")
    dtype = next(model.parameters()).dtype
    if quantization is None and (kernels is None or dtype not in DenseLinear.DTYPES):
        return  # nothing to gain: torch's own layers are the path
    fast = _layer_factory(quantization, kernels, int4, quantized_kernels)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RowParallelLinear):
                setattr(parent, name, _row_parallel(child, quantization, fast))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, fast(child, parent is model and name == "lm_head", None))


def _row_parallel(linear: RowParallelLinear, quantization: str | None, fast: LayerFactory) -> QuantizedRowParallel:
    """A row-parallel shard quantized on its own, all-reduced as before. int8 scales each output row by the
    whole row's largest |weight| (the ranks' maxima, all-reduced: every rank calls this for the same layers in
    the same order), so the shard's codes are the unsplit layer's, sliced. int4's groups lie within the shard
    (the loader refuses a split off the group boundaries), so its codes and scales are the unsplit ones too."""
    absmax = None
    if quantization == "int8":
        absmax = linear.parallel.max_over_ranks(linear.weight.detach().float().abs().amax(dim=1))
    return QuantizedRowParallel(fast(local_share(linear), False, absmax), linear.bias, linear.parallel)


def quantized_matmul_name(model: nn.Module) -> str | None:
    """What the model's quantized layers run (their `matmul_name`); None when no layer is quantized."""
    layers = (m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear)))
    return next((layer.matmul_name for layer in layers), None)


def _layer_factory(quantization: str | None, kernels: CpuKernels | None, int4: Int4Options | None,
                   quantized_kernels: QuantizedKernels | None) -> LayerFactory:
    """(linear, is the LM head, int8's row maxima or None) -> the layer that replaces it."""
    if quantization == "int8":
        return lambda linear, _, absmax: Int8Linear(linear, kernels, quantized_kernels, absmax)
    if quantization == "int4":
        options = int4 or Int4Options()

        def int4_layer(linear: nn.Linear, lm_head: bool, _: torch.Tensor | None) -> nn.Module:
            if lm_head and not options.lm_head:
                return DenseLinear(linear, kernels)
            return Int4Linear(quantize_int4(linear.weight, options), linear.bias, quantized_kernels)

        return int4_layer
    return lambda linear, _, __: DenseLinear(linear, kernels)
