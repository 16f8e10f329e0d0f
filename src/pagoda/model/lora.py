"""Batched LoRA: the rows of several adapters and of the base model in one step, on the base's fused projections.

Adapters live in stacked tensors, one slot each (`LoRAStack`: per projection, A `[layers, slots, max_rank, in]` and
B `[layers, out, slots, max_rank]`, a slot's entries beyond its adapter's rank and in the projections it does not
target being zero); the caller loads an adapter into a slot (`load`) and, before each forward, says which slot
each token's row uses (`begin_step`: -1 for the base). Each of a layer's four linears is wrapped (`LoRALinear`):
the base output first, then for each projection an adapter of the step targets, every row's
`(x A^T) B^T * scaling` added to that projection's columns inside the fused output (q/k/v in qkv_proj, gate/up
in gate_up_proj; a Phi-3 adapter's qkv_proj or gate_up_proj: all of them, the checkpoint's fused order being
ours). All slots go in one pair of matmuls per projection, whatever the mix of adapters: x against every
slot's A at once, each row's products outside its own slot's block masked to zero, then against every slot's B,
and the row scaled by its adapter's scaling. A masked product is an exact zero, so each row gets what PEFT
computes for it, `W x + B(A x) * scaling`, in the same order of operations; the price is the other slots' rank in flops,
small beside the base projection, against a pair of matmuls per adapter in Python.

The native decode stack takes no adapters: a step with any adapter row runs through the modules, and base-only
steps keep the stack (`attach_lora` gates the backend's decode runner on the step's rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.model.attention import AttentionMetadata, DecodeRunner
from pagoda.model.kv_cache import LayerKV
from pagoda.model.lora_checkpoint import LoRAAdapter, module_shape

if TYPE_CHECKING:
    from pagoda.model.layers import GatedMLP
    from pagoda.model.llama import DecoderLayer, LlamaModel

# (PEFT module, first column, end column) inside one of our linears' output.
Parts = tuple[tuple[str, int, int], ...]


class LoRAStack:
    """Every slot's adapter weights, and which rows of the current step use which slot."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.dtype, self.device = dtype, device
        # Per PEFT module, allocated when an adapter first targets it (zeros: what no adapter holds adds nothing).
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.modules_of: list[set[str]] = [set() for _ in range(max_loras)]  # the modules each slot's adapter targets
        self.scaling = [0.0] * max_loras
        self.targeted: set[str] = set()  # the current step's adapters' modules; empty: a base-only step
        self.mask = torch.zeros(0)  # [rows, slots * max_rank]: 1 in each row's own slot's block
        self.row_scaling = torch.zeros(0)  # [rows, 1]: each row's adapter's scaling (0 for a base row)

    @property
    def active(self) -> bool:
        """Whether the current step has adapter rows."""
        return bool(self.targeted)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` in `slot`, replacing what the slot held (all of it: the masked matmuls read every entry)."""
        for module in self.a:
            self.a[module][:, slot].zero_()
            self.b[module][:, :, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            if module not in self.a:
                fan_in, fan_out = module_shape(self.config, module)
                layers, slots, rank = self.config.num_layers, self.max_loras, self.max_rank
                self.a[module] = torch.zeros(layers, slots, rank, fan_in, dtype=self.dtype, device=self.device)
                self.b[module] = torch.zeros(layers, fan_out, slots, rank, dtype=self.dtype, device=self.device)
            rank = a.shape[0]
            self.a[module][layer, slot, :rank].copy_(a)
            self.b[module][layer, :, slot, :rank].copy_(b)
        self.modules_of[slot] = {module for _, module in adapter.weights}
        self.scaling[slot] = adapter.scaling

    def begin_step(self, token_slots: Sequence[int] | None) -> None:
        """The slot of each row of the next forward (-1: the base model); None: no adapter row at all."""
        self.targeted = set()
        slots = {slot for slot in token_slots or () if slot >= 0}
        if not slots:
            return
        self.targeted = set().union(*(self.modules_of[slot] for slot in slots))
        rows = torch.tensor(token_slots, dtype=torch.long)
        adapter_rows = rows >= 0
        mask = torch.zeros(len(rows), self.max_loras, self.max_rank, dtype=self.dtype)
        mask[adapter_rows, rows[adapter_rows]] = 1
        scaling = torch.tensor(self.scaling + [0.0], dtype=self.dtype)  # index -1: a base row's 0
        self.mask = mask.view(len(rows), -1).to(self.device)
        self.row_scaling = scaling[rows].unsqueeze(1).to(self.device)

    def add_deltas(self, layer: int, parts: Parts, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, columns of each part] += (x A^T) B^T * scaling, each row with its own slot's A, B and scaling."""
        for module, start, end in parts:
            if module not in self.targeted:
                continue
            a = self.a[module][layer].view(-1, x.shape[-1])  # [slots * max_rank, in]
            b = self.b[module][layer].view(end - start, -1)  # [out, slots * max_rank]
            out[:, start:end].add_(F.linear(F.linear(x, a) * self.mask, b) * self.row_scaling)


class LoRALinear(nn.Module):
    """One of a layer's linears (fused or not), its output with the step's adapter deltas added."""

    def __init__(self, base: nn.Module, stack: LoRAStack, layer: int, parts: Parts) -> None:
        super().__init__()
        self.base = base
        self.stack = stack
        self.layer, self.parts = layer, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        if self.stack.targeted:
            self.stack.add_deltas(self.layer, self.parts, x, out)
        return out


class BaseOnlyDecode:
    """The backend's decode runner, for steps without adapter rows only (the native stack knows no adapters)."""

    def __init__(self, inner: DecodeRunner, stack: LoRAStack) -> None:
        self.inner, self.stack = inner, stack

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return not self.stack.active and self.inner.takes(meta, num_tokens)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        return self.inner(x, cos, sin, kv_caches, meta)


def attach_lora(model: LlamaModel, max_loras: int, max_rank: int) -> LoRAStack:
    """Wraps the model's q/k/v/o/gate/up/down linears with `max_loras` adapter slots of rank up to `max_rank`.
    Called once the weights are final (after `load_model`): the linears wrapped are the prepared ones."""
    if model.parallel is not None:
        raise ValueError("LoRA adapters are not served on a model split across ranks yet")
    if model.config.moe is not None:
        raise ValueError("LoRA adapters are not served on a mixture-of-experts model yet")
    config = model.config
    stack = LoRAStack(config, max_loras, max_rank, model.dtype, next(model.parameters()).device)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    for index, layer in enumerate(cast("list[DecoderLayer]", list(model.layers))):
        attention, mlp = layer.self_attn, cast("GatedMLP", layer.mlp)
        # add_module replaces the child in place: the modules call it by the same attribute.
        # Both layouts' parts: an adapter targets the split projections or (Phi-3) the fused ones, never both,
        # and a part no adapter of the step targets costs nothing.
        attention.add_module("qkv_proj", LoRALinear(attention.qkv_proj, stack, index, (
            ("q_proj", 0, q_size), ("k_proj", q_size, q_size + kv_size),
            ("v_proj", q_size + kv_size, q_size + 2 * kv_size), ("qkv_proj", 0, q_size + 2 * kv_size))))
        attention.add_module("o_proj", LoRALinear(attention.o_proj, stack, index, (("o_proj", 0, config.hidden_size),)))
        mlp.add_module("gate_up_proj", LoRALinear(mlp.gate_up_proj, stack, index,
                                                  (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter),
                                                   ("gate_up_proj", 0, 2 * inter))))
        mlp.add_module("down_proj", LoRALinear(mlp.down_proj, stack, index, (("down_proj", 0, config.hidden_size),)))
    backend = model.backend
    if backend.decode_runner is not None:
        backend.decode_runner = BaseOnlyDecode(backend.decode_runner, stack)
    return stack
