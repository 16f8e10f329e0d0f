"""Decode-only steps through one native call for the whole layer stack (kernels/cpu_decode.cpp).

The stack runs the very kernels the module path calls, in the same order, so its output is the module
path's bit for bit; what it removes is the interpreter between them: ~10 module calls and op
dispatches a layer, 2-6 ms a step on bench-1b (22 layers), during which no weight streams. It takes a
step when every token is a decode and every linear runs as a GEMV (at most KERNEL_MAX_ROWS tokens);
prefills, larger batches and models it does not cover (an input width the GEMVs do not take, a head
size the attention kernel does not) run through the modules.
"""

from __future__ import annotations

import torch

from pagoda.model.attention import AttentionMetadata, CpuAttentionBackend
from pagoda.model.quantization import KERNEL_MAX_ROWS, DenseLinear, Int8Linear


def _linear_spec(linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """(weight, int8 scale, bias) of a linear that runs decode inputs as a GEMV, else None."""
    if isinstance(linear, DenseLinear) and linear.gemv is not None:
        return linear.weight, None, linear.bias
    if isinstance(linear, Int8Linear) and linear.kernels is not None:
        return linear.qweight, linear.scale, linear.bias
    return None


class NativeDecode:
    def __init__(self, model, kernels) -> None:
        config = model.config
        attention = model.layers[0].self_attn
        self.stack = kernels.DecodeStack(config.num_heads, config.num_kv_heads, config.head_dim, model.norm.eps,
                                         attention.scale, model.norm.weight)
        for layer in model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            q_norm, k_norm = attention.q_norm, attention.k_norm  # Qwen3's per-head norms, or None
            head_norms = (None, None) if q_norm is None else (q_norm.weight, k_norm.weight)
            self.stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *head_norms,
                                 *map(_linear_spec, linears), attention.window or 0)

    @staticmethod
    def covers(model) -> bool:
        """Whether every layer's operations have a kernel: the native attention backend, every linear a GEMV."""
        if not isinstance(model.backend, CpuAttentionBackend):
            return False
        return all(_linear_spec(linear) is not None for layer in model.layers
                   for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                  layer.mlp.down_proj))

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return not meta.prefills and num_tokens <= KERNEL_MAX_ROWS

    def __call__(self, x, cos, sin, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for the step's tokens; x (the embedded tokens) is updated in place."""
        return self.stack.forward(x, cos, sin, kv_caches, meta.slot_mapping, meta.decode_key_slots,
                                  meta.decode_seq_lens)
