"""x @ W.T a tile of W at a time, beyond the kernels' row bounds: what the int8 and dense layers
(quantization.py) and int4 (int4.py) share, below all three."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.kernels import cpu_lacks_native_bf16

TILE_ROWS = 256  # output rows dequantized at a time for a GEMM


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a GEMM of `dtype` inputs runs in: bf16 in fp32 on a CPU without bf16 arithmetic, where torch's
    bf16 GEMM emulates it at a fifth of the fp32 rate; widening a tile of W costs little beside its GEMM."""
    return torch.float32 if dtype == torch.bfloat16 and cpu_lacks_native_bf16() else dtype


def tiled_matmul(x: torch.Tensor, out_features: int,
                 weight_rows: Callable[[int, int, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """x @ W.T in x's dtype, for a weight kept quantized or in a dtype the GEMM does not run in:
    `weight_rows(start, end, dtype)` gives W[start:end] in `gemm_dtype(x.dtype)`, a tile at a time straight into
    its GEMM. Dequantizing a whole fp32 weight per call costs more in page faults (a fresh buffer each time) than
    in arithmetic; a tile's buffer is reused and stays in cache."""
    compute = gemm_dtype(x.dtype)
    x_compute = x.to(compute)
    y = torch.empty(x.shape[0], out_features, dtype=compute)
    for start in range(0, out_features, TILE_ROWS):
        end = min(start + TILE_ROWS, out_features)
        torch.mm(x_compute, weight_rows(start, end, compute).t(), out=y[:, start:end])
    return y.to(x.dtype)
