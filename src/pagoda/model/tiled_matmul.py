"""x @ W.T for a weight kept quantized, beyond the integer kernels' row bounds: what the int8 (quantization.py)
and int4 (int4.py) layers share, below both."""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE_ROWS = 256  # output rows dequantized at a time for a GEMM


def tiled_matmul(x: torch.Tensor, out_features: int,
                 dequantize_rows: Callable[[int, int, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """x @ W.T for a weight kept quantized: `dequantize_rows(start, end, dtype)` gives W[start:end], a tile at a
    time straight into its GEMM. Dequantizing a whole fp32 weight per call costs more in page faults (a fresh
    buffer each time) than in arithmetic; a tile's buffer is reused and stays in cache."""
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, TILE_ROWS):
        end = min(start + TILE_ROWS, out_features)
        torch.mm(x, dequantize_rows(start, end, x.dtype).t(), out=y[:, start:end])
    return y
