"""One layer's paged KV cache in its storage format (`LayerKV`), and the quantizers that write it.

A layer's cache is K and V, `[num_slots, kv_heads, head_dim]` each (num_slots = blocks x block_size), in the
model's dtype, or quantized (pagoda/kv_format.py, `--kv-cache-dtype`):

- int8: symmetric codes with an fp32 scale per token and KV head, `[num_slots, kv_heads]` for K and for V, beside
  the codes with the same slot-major first dimension: whatever moves a slot's rows across `tensors()` (a
  speculative branch kept, an offload) moves its codes and scales together.
- fp8_e4m3: torch.float8_e4m3fn codes of K / k_scale and V / v_scale, one fp32 scale each per layer (1.0, or
  amax / 448 of the first K/V written with `calculate_kv_scales`), as vLLM's fp8 KV cache.

Quantization rounds as the native kernels do (kernels/kv_quant.h): x / scale in fp32, rounded half to even
(int8) or to the nearest e4m3 (fp8), so either writer leaves the same bytes. Readers dequantize only what they
gather (one decode batch's keys, one prefill's): there is never a dequantized copy of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kv_format import FP8_E4M3_MAX, INT8_MAX, is_quantized, kv_cache_dtype_name

CODE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 codes [..., D], fp32 scales [...]): per row, scale = amax / 127, codes =
    round(x / scale) (an all-zero row: scale 0, codes 0)."""
    values = x.float()
    scales = values.abs().amax(dim=-1) / INT8_MAX
    divided = torch.where(scales[..., None] > 0, values / scales[..., None], 0.0)
    return divided.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as e4m3, saturated at +-448 (e4m3 has no infinity)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] back to `dtype`: int8 times its per-row scales [...]; fp8 times its layer scale [1]; codes
    in a model dtype are converted only."""
    if scale is None:
        return codes.to(dtype)
    if codes.dtype == torch.int8:
        return (codes.float() * scale[..., None]).to(dtype)
    return (codes.float() * scale).to(dtype)


@dataclass(eq=False)
class LayerKV:
    """One layer's paged KV cache. `k`, `v`: [num_slots, kv_heads, head_dim] in the model's dtype, int8 codes or
    float8_e4m3fn codes. `k_scale`, `v_scale`: int8's per-token-per-head scales [num_slots, kv_heads] fp32; fp8's
    layer scales [1] fp32; None for the model's dtype."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # fp8 with calculate_kv_scales: the scales are set from the first K/V written (`calibrate`), then kept.
    scales_pending: bool = False

    @classmethod
    def allocate(cls, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: str = "auto",
                 device: str | torch.device = "cpu", calculate_scales: bool = False) -> LayerKV:
        """An unwritten cache (not zero-filled: a page becomes resident when a token is first written there, and
        attention reads only written slots)."""
        name = kv_cache_dtype_name(cache_dtype)
        shape = (num_slots, kv_heads, head_dim)
        if not is_quantized(name):
            return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
        codes = CODE_DTYPES[name]
        k, v = torch.empty(shape, dtype=codes, device=device), torch.empty(shape, dtype=codes, device=device)
        if name == "int8":
            scales = (num_slots, kv_heads)
            return cls(k, v, torch.empty(scales, device=device), torch.empty(scales, device=device))
        return cls(k, v, torch.ones(1, device=device), torch.ones(1, device=device), scales_pending=calculate_scales)

    @property
    def format(self) -> str:
        """"int8", "fp8_e4m3", or "auto" (the model's dtype)."""
        return {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}.get(self.k.dtype, "auto")

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor whose first dimension is the slot: a slot's K/V is its row in each of them."""
        if self.format == "int8":
            assert self.k_scale is not None and self.v_scale is not None
            return self.k, self.v, self.k_scale, self.v_scale
        return self.k, self.v

    def copy_slot(self, source: int, target: int) -> None:
        """The K/V at slot `source` copied to slot `target`, scales included."""
        for tensor in self.tensors():
            tensor[target] = tensor[source]

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(k, v, k_scale, v_scale) as the native kernels take them."""
        return self.k, self.v, self.k_scale, self.v_scale

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Where the scales are pending: each set to amax / 448 of the K (or V) about to be written first."""
        if not self.scales_pending:
            return
        assert self.k_scale is not None and self.v_scale is not None
        for scale, values in ((self.k_scale, k), (self.v_scale, v)):
            amax = float(values.float().abs().max()) if values.numel() else 0.0
            scale.fill_(amax / FP8_E4M3_MAX if amax > 0 else 1.0)
        self.scales_pending = False

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [tokens, kv_heads, head_dim] in the model's dtype, stored at `slots` in the cache's format."""
        self.calibrate(k, v)
        fmt = self.format
        if fmt == "auto":
            self.k.index_copy_(0, slots, k)
            self.v.index_copy_(0, slots, v)
            return
        assert self.k_scale is not None and self.v_scale is not None
        if fmt == "int8":
            for cache, scales, values in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                codes, token_scales = quantize_int8(values)
                cache.index_copy_(0, slots, codes)
                scales.index_copy_(0, slots, token_scales)
            return
        for cache, scale, values in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            # Through a byte view: torch has no index_copy_ for float8 on the CPU.
            cache.view(torch.uint8).index_copy_(0, slots, quantize_fp8(values, scale).view(torch.uint8))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V at `slots` (any shape), dequantized to `dtype`: [*slots.shape, kv_heads, head_dim] each."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.k.shape[1:])
        fmt = self.format
        out = []
        for cache, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            codes = cache.index_select(0, flat)
            if fmt == "int8":
                assert scale is not None
                scale = scale.index_select(0, flat)
            out.append(dequantize(codes, scale, dtype).view(shape))
        return out[0], out[1]
