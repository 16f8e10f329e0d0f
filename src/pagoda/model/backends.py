"""Which implementation a model runs, decided once, when it is built: `create_runtime` is the one place.

The compiled CPU kernels (pagoda.kernels, typed as model/kernel_protocols.py's `CpuKernels`) are handed to the
parts that use them at construction; nothing is patched into a model afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.config import ModelConfig
from pagoda.model.attention import AttentionBackend, CpuAttentionBackend, TorchAttentionBackend
from pagoda.model.kernel_protocols import CpuKernels, QuantizedKernels
from pagoda.model.parallel import TensorParallel
from pagoda.model.pipeline import PipelineStage
from pagoda.model.quantization import gemv_takes
from pagoda.model.softcap_attention import SoftCappedAttentionBackend, SoftCappedCpuAttentionBackend


@dataclass(frozen=True)
class ModelRuntime:
    """The implementations one model runs (`create_runtime`); the default is the torch reference throughout."""

    attention: AttentionBackend = field(default_factory=TorchAttentionBackend)
    kernels: CpuKernels | None = None  # the norms' fused residual add + RMSNorm and the MLP's SiLU gate
    gemv_kernels: CpuKernels | None = None  # the linears' GEMVs, for `prepare_linears`
    quantized_kernels: QuantizedKernels | None = None  # the quantized layers' integer matmuls (AVX2)
    parallel: TensorParallel | None = None  # this rank's place when the model is split across ranks (None: whole)
    pipeline: PipelineStage | None = None  # the layers this rank's pipeline stage holds (None: all of them)


def create_runtime(config: ModelConfig, dtype: torch.dtype, kernels: CpuKernels | None,
                   quantization: str | None = None,
                   quantized_kernels: QuantizedKernels | None = None) -> ModelRuntime:
    """The implementations a model of `config` in `dtype` runs. kernels: pagoda's compiled CPU kernels for a
    model on the CPU that may use them; None: the torch reference throughout. quantized_kernels: the module
    with the integer matmuls (the full set, or on AVX2-only CPUs the AVX2 module), which the quantized layers
    run up to their row bounds: int4 always, int8 unless the kernels are the AVX-512 set (whose int8 GEMV the
    native decode stack shares with the layers); None: torch's int4/int8 matmuls. With kernels:

    - the linears run their GEMVs, in any dtype (`prepare_linears` decides per layer);
    - fp32/bf16 models also fuse the norms' residual add + RMSNorm and the MLP's SiLU gate;
    - and where the attention kernels take the shape (head_dim 16..128 in steps of 16, at most 16 query
      heads per kv head), attend through the native backend: paged attention, rope + KV write in one call;
    - and where every layer's linear runs as a GEMV too (input widths a multiple of 32) and the layers are
      Llama's, OLMo 2's or Gemma's (`decode_stack_takes_layers`), run decode-only steps through the native
      decode stack, which `native_decode.bind_decode_stack` builds once the weights are final (and only if they
      are what it takes: `decode_stack_covers`).

    Soft-capped attention (Gemma 2) runs the `softcap_attention` backends: the paged decode kernel (and the stack)
    cap scores, prefills attend as the reference does.
    """
    # The portable targets' (AVX-512F, AVX2, NEON) int8 GEMV is their integer matmul, which the layers then run up
    # to its own row bound.
    int8_matmul = kernels is None or kernels.target != "avx512"
    integer = quantized_kernels if quantization == "int4" or (quantization == "int8" and int8_matmul) else None
    fused = kernels if dtype in (torch.float32, torch.bfloat16) else None
    softcap = config.attn_logit_softcapping
    group = config.num_heads // config.num_kv_heads
    attention_kernels = config.head_dim % 16 == 0 and config.head_dim <= 128 and group <= 16  # the kernels' shapes
    if fused is None or not attention_kernels:
        reference = TorchAttentionBackend() if softcap is None else SoftCappedAttentionBackend(softcap)
        return ModelRuntime(reference, kernels=fused, gemv_kernels=kernels, quantized_kernels=integer)
    linear_widths = (config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size,
                     *(() if config.moe is None else (config.moe.expert_intermediate_size,
                                                      config.moe.shared_expert_intermediate_size or 32)))
    decode_stack = all(gemv_takes(width) for width in linear_widths) and decode_stack_takes_layers(config)
    attention = CpuAttentionBackend(fused, decode_stack) if softcap is None else \
        SoftCappedCpuAttentionBackend(fused, softcap, decode_stack)
    return ModelRuntime(attention, kernels=fused, gemv_kernels=kernels, quantized_kernels=integer)


def decode_stack_takes_layers(config: ModelConfig) -> bool:
    """Whether every layer is one the native decode stack computes: Llama's (pre-norms, optional per-head q/k
    norms), OLMo 2's (post-norms scaled in fp32, q/k norms across the heads) or Gemma's (sandwich norms scaled by
    1 + weight, per-head q/k norms in Gemma 3, a rope table of their own for Gemma 3's sliding layers), with a SiLU
    or GeGLU gate. Embedding multipliers and logit soft-capping run outside it; its attention caps scores where the
    model does (Gemma 2)."""
    placement, per_head = config.norm_placement, config.qk_norm_per_head
    return (placement in ("pre", "sandwich") and (per_head or not config.qk_norm)) or (
        placement == "post" and config.qk_norm and not per_head)
