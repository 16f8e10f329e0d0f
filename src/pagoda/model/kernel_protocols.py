"""The compiled CPU kernels (pagoda.kernels) as model/ calls them: typed once, below every module that
takes them, so the layers, the quantized linears, attention and the decode stack import these types and not
the module that decides which implementation runs (backends.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

# weight, scale (int8: per channel; int4: the (scale, offset) pairs), bias; as kernels/cpu_decode.cpp reads it
LinearSpec = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# One layer's KV cache as the kernels take it (kv_cache.LayerKV.kernel_args): k, v, and their scales (int8: per
# token and head [slots, kv_heads]; fp8: the layer's [1]; None: the model's dtype).
KVSpec = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


# A KV cache group's attention inputs for a decode step (AttentionMetadata's): slot_mapping, decode_key_slots,
# decode_seq_lens.
GroupInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CompiledDecodeStack(Protocol):
    """kernels/cpu_decode.cpp's DecodeStack."""

    def add_layer(self, input_layernorm: torch.Tensor | None, post_attention_layernorm: torch.Tensor,
                  pre_feedforward_layernorm: torch.Tensor | None, post_feedforward_layernorm: torch.Tensor | None,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qkv: LinearSpec, o: LinearSpec,
                  gate_up: LinearSpec | None, down: LinearSpec | None, window: int, sliding_rope: bool) -> None: ...

    def set_experts(self, layer: int, router: torch.Tensor, top_k: int, renormalise: bool,
                    routed_tokens: torch.Tensor, gate_ups: list[LinearSpec], downs: list[LinearSpec],
                    shared: tuple[LinearSpec, LinearSpec, torch.Tensor] | None) -> None: ...

    def set_all_reduce(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None: ...

    def forward(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list[KVSpec],
                groups: list[GroupInputs], layer_groups: Sequence[int]) -> torch.Tensor: ...

    def add_lora_part(self, layer: int, linear: int, module: int, start: int, end: int, a: torch.Tensor,
                      bt: torch.Tensor) -> None: ...

    def forward_lora(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list[KVSpec],
                     groups: list[GroupInputs], layer_groups: Sequence[int], row_slots: torch.Tensor,
                     row_scaling: torch.Tensor, targeted: list[int]) -> torch.Tensor: ...


class QuantizedKernels(Protocol):
    """A compiled module with the integer matmuls for quantized weights (kernels/cpu_int4.cpp, cpu_int8.cpp;
    AVX2): the full set's, or the AVX2 module's."""

    # The most rows of x at which matmul_int4 beats dequantized tiles into a GEMM (sys.maxsize: no bound).
    matmul_int4_max_rows: int

    def matmul_int4(self, x: torch.Tensor, packed: torch.Tensor, group: int,
                    scales_and_zeros: torch.Tensor) -> torch.Tensor: ...
    def matmul_int8(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...


class CpuKernels(QuantizedKernels, Protocol):
    """The compiled module of pagoda's CPU kernels for one target (kernels/cpu_module.cpp: "avx512";
    cpu_simd_module.cpp: "avx512f", "avx2" or "neon", which have no prefill attention), as model/ calls it."""

    target: str
    gemv_max_rows: int  # the most rows of x gemv_fp32/bf16/int8 take (beyond: a GEMM's work)
    DecodeStack: Callable[[int, int, int, float, float, float, torch.Tensor, str, bool, bool], CompiledDecodeStack]
    prefill_attention_amx: bool  # bf16 prefill attention runs on AMX tiles (the CPU has them, Linux granted them)

    def gemv_fp32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...
    def gemv_bf16(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...
    def gemv_int8(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...
    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> torch.Tensor: ...
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def moe_route(self, x: torch.Tensor, router: torch.Tensor, top_k: int,
                  renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]: ...
    def lora_add_(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, row_slots: torch.Tensor,
                  row_scaling: torch.Tensor) -> None: ...
    def rotary_write_kv_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None: ...
    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               key_slots: torch.Tensor, seq_lens: torch.Tensor, window: int, scale: float,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                               softcap: float = 0.0) -> torch.Tensor: ...
    # the "avx512" target only
    def paged_prefill_attention_(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 key_slots: torch.Tensor, window: int, scale: float, out: torch.Tensor,
                                 use_amx: bool = True) -> None: ...
