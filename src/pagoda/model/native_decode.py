"""Decode-only steps through one native call for the whole layer stack (kernels/cpu_decode.cpp).

The stack runs the very kernels the module path calls, in the same order, so its output is the module
path's bit for bit; what it removes is the interpreter between them: ~10 module calls and op
dispatches a layer, 2-6 ms a step on bench-1b (22 layers), during which no weight streams. It takes a
step when every token is a decode and every linear runs as a GEMV (at most `max_rows` tokens);
prefills and larger batches run through the modules. LoRA adapters' deltas run inside it too (model/lora.py's
`AdapterDecode` hands it their weights and each step's rows). `backends.create_runtime` offers it to models whose
shapes it takes (the native attention backend, every linear's width a GEMV's), and `bind_decode_stack` builds
it once the weights are final if `decode_stack_covers` them (every linear runs decode inputs straight through a
kernel). A mixture of experts' sparse layers run in it as the modules run them, reading only the chosen experts
(not under expert parallelism, whose rows travel between ranks). A step over several KV cache groups (sliding
and full layers apart) runs in it too: each layer reads through its own group's block tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pagoda.model.attention import AttentionMetadata, CpuAttentionBackend
from pagoda.model.int4 import Int4Linear
from pagoda.model.kv_cache import LayerKV
from pagoda.model.moe import SparseMoeBlock
from pagoda.model.parallel import QuantizedRowParallel
from pagoda.model.quantization import KERNEL_MAX_ROWS, DenseLinear, Int8Linear

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CompiledDecodeStack, CpuKernels, GroupInputs, LinearSpec
    from pagoda.model.layers import GatedMLP, RMSNorm
    from pagoda.model.llama import DecoderLayer, LlamaModel, RopeTables


def _linear_spec(linear: nn.Module) -> LinearSpec | None:
    """(weight, scale, bias) of a linear that runs decode inputs straight through a kernel, else None. A
    tensor-parallel rank's row-parallel linear gives its shard's weight and the whole bias, which the stack adds
    after the all-reduce."""
    if isinstance(linear, QuantizedRowParallel):
        local = _linear_spec(linear.local)
        return None if local is None else (local[0], local[1], linear.bias)
    if isinstance(linear, DenseLinear) and linear.gemv is not None:
        return linear.weight, None, linear.bias
    if isinstance(linear, Int8Linear) and linear.kernels is not None:
        return linear.qweight, linear.scale, linear.bias
    if isinstance(linear, Int4Linear) and linear.runs_kernel_unpadded:
        return linear.packed, linear.scales_and_zeros, linear.bias
    return None


def _mlp_linears(mlp: GatedMLP) -> tuple[nn.Module, nn.Module]:
    return mlp.gate_up_proj, mlp.down_proj


def _layer_linears(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    """The layer's linears: attention's qkv and o, then a dense MLP's gate_up and down, or every expert's (and a
    shared expert's)."""
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, SparseMoeBlock):
        return attention.qkv_proj, attention.o_proj, *_mlp_linears(mlp)
    shared = () if mlp.shared_expert is None else _mlp_linears(mlp.shared_expert)
    return attention.qkv_proj, attention.o_proj, *mlp.experts.gate_up, *mlp.experts.down, *shared


def decode_stack_covers(model: LlamaModel) -> bool:
    """Whether every layer's linears run decode inputs straight through a kernel (a prequantized int4 checkpoint
    with act-order or ragged shapes may not), and every sparse layer holds all its experts (under expert
    parallelism the rows travel between ranks: the modules' all-to-all)."""
    layers = cast("list[DecoderLayer]", list(model.layers))
    if model.parallel is not None and any(isinstance(layer.mlp, SparseMoeBlock) for layer in layers):
        return False
    return all(_linear_spec(linear) is not None for layer in layers for linear in _layer_linears(layer))


def _set_experts(stack: CompiledDecodeStack, index: int, block: SparseMoeBlock) -> None:
    """Gives the stack's layer `index` the block's experts (all of them: the stack takes no expert parallelism)."""
    spec = cast("Callable[[nn.Module], LinearSpec]", _linear_spec)
    shared = None
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        gate_up, down = map(spec, _mlp_linears(block.shared_expert))
        shared = (gate_up, down, block.shared_expert_gate.weight)
    stack.set_experts(index, block.gate.weight, block.gate.top_k, block.gate.renormalise, block.routed_counter(),
                      [spec(linear) for linear in block.experts.gate_up],
                      [spec(linear) for linear in block.experts.down], shared)


def bind_decode_stack(model: LlamaModel) -> None:
    """Called once the model's weights are final (loaded, linears prepared): where the runtime offered the
    stack (`CpuAttentionBackend.decode_stack`) and the weights are what it takes, it becomes the attention
    backend's decode runner."""
    backend = model.backend
    whole = model.embed_tokens is not None and model.norm is not None  # not a pipeline stage
    if isinstance(backend, CpuAttentionBackend) and backend.decode_stack and whole and decode_stack_covers(model):
        backend.decode_runner = NativeDecode(model, backend.kernels)


class NativeDecode:
    def __init__(self, model: LlamaModel, kernels: CpuKernels) -> None:
        config = model.config
        layers = cast("list[DecoderLayer]", list(model.layers))
        norm = model.norm
        assert norm is not None, "the decode stack runs a whole model, not a pipeline stage"
        self.kernels = kernels
        placement = config.norm_placement  # backends.decode_stack_takes_layers: pre, post or sandwich

        def scale(module: RMSNorm | None) -> torch.Tensor | None:
            return None if module is None else module.scale()

        self.stack = kernels.DecodeStack(config.num_heads, config.num_kv_heads, config.head_dim, norm.eps,
                                         layers[0].self_attn.scale, config.attn_logit_softcapping or 0.0,
                                         norm.scale(), placement,
                                         config.norm_unit_offset, config.hidden_act != "silu")
        if model.parallel is not None:  # o and down are row-parallel: their partial sums are added across ranks
            self.stack.set_all_reduce(model.parallel.all_reduce)
        for index, layer in enumerate(layers):
            attention, sparse = layer.self_attn, isinstance(layer.mlp, SparseMoeBlock)
            qkv, o, *mlp = (cast("LinearSpec", _linear_spec(linear)) for linear in _layer_linears(layer))
            gate_up, down = (None, None) if sparse else (mlp[0], mlp[1])
            self.stack.add_layer(scale(getattr(layer, "input_layernorm", None)),
                                 layer.post_attention_layernorm.scale(),
                                 scale(getattr(layer, "pre_feedforward_layernorm", None)),
                                 scale(getattr(layer, "post_feedforward_layernorm", None)),
                                 scale(attention.q_norm), scale(attention.k_norm),
                                 qkv, o, gate_up, down, attention.window or 0, layer.sliding_rope)
            if isinstance(layer.mlp, SparseMoeBlock):
                _set_experts(self.stack, index, layer.mlp)
        # The most tokens a step may have: every dense linear's GEMV bound, as the modules apply it.
        dense = [linear for layer in layers for linear in _layer_linears(layer) if isinstance(linear, DenseLinear)]
        self.max_rows = min((linear.max_rows for linear in dense), default=KERNEL_MAX_ROWS)
        self._one_group = [0] * len(layers)

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return not meta.prefills and num_tokens <= self.max_rows

    def _groups(self, meta: AttentionMetadata) -> tuple[list[GroupInputs], Sequence[int]]:
        """Each KV cache group's attention inputs, and each layer's group."""
        if not meta.layer_groups:
            return [(meta.slot_mapping, meta.decode_key_slots, meta.decode_seq_lens)], self._one_group
        return ([(group.slot_mapping, group.decode_key_slots, group.decode_seq_lens) for group in meta.group_metas],
                meta.layer_groups)

    def __call__(self, x: torch.Tensor, ropes: list[RopeTables], kv_caches: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for the step's tokens; x (the embedded tokens) is updated in place. ropes: the
        step's tables, then the sliding layers' own where the model has them."""
        groups, layer_groups = self._groups(meta)
        return self.stack.forward(x, ropes, [kv.kernel_args() for kv in kv_caches], groups, layer_groups)

    def forward_lora(self, x: torch.Tensor, ropes: list[RopeTables], kv_caches: list[LayerKV],
                     meta: AttentionMetadata, row_slots: torch.Tensor, row_scaling: torch.Tensor,
                     targeted: list[int]) -> torch.Tensor:
        """As a call, with the adapter parts the stack was given (`stack.add_lora_part`) that `targeted` names
        added to their linears' outputs: each row's from its own slot (`row_slots`, int64, -1: the base), scaled
        by its `row_scaling` (fp32)."""
        groups, layer_groups = self._groups(meta)
        return self.stack.forward_lora(x, ropes, [kv.kernel_args() for kv in kv_caches], groups, layer_groups,
                                       row_slots, row_scaling, targeted)
