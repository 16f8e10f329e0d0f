"""Batched LoRA: the rows of several adapters and of the base model in one step, on the base's fused projections.

Adapters live in stacked tensors, one slot each (`LoRAStack`: per projection, A `[layers, slots, max_rank, in]` and
B `[layers, slots, out, max_rank]`); the caller loads an adapter into a slot (`load`) and, before each forward,
says which slot each token's row uses (`begin_step`: -1 for the base). Each of a layer's four linears is wrapped
(`LoRALinear`): the base output first, then for each slot in the step, its rows' `(x A^T) B^T * scaling` added
to the columns of the projection it targets inside the fused output (q/k/v in qkv_proj, gate/up in
gate_up_proj; a Phi-3 adapter's qkv_proj or gate_up_proj: all of them, the checkpoint's fused order being
ours), the SGMV shape: one pair of matmuls per slot and projection, over all of that slot's rows. A
projection an adapter does not target costs nothing, and an adapter's rank is its own (A and B are sliced to
it): each row computes what PEFT computes for it, `W x + B(A x) * scaling`, in the same order.

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
Rows = slice | torch.Tensor  # a contiguous run of the step's rows, or their indices


class LoRAStack:
    """Every slot's adapter weights, and which rows of the current step use which slot."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.dtype, self.device = dtype, device
        # Per PEFT module, allocated when an adapter first targets it (zeros: a slot reads only its rank's part).
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.ranks: list[dict[tuple[int, str], int]] = [{} for _ in range(max_loras)]  # 0 / absent: not targeted
        self.scaling = [0.0] * max_loras
        self.groups: list[tuple[int, Rows]] = []  # the current step's (slot, rows); empty: a base-only step

    @property
    def active(self) -> bool:
        """Whether the current step has adapter rows."""
        return bool(self.groups)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` in `slot`, replacing what the slot held."""
        ranks: dict[tuple[int, str], int] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            if module not in self.a:
                fan_in, fan_out = module_shape(self.config, module)
                shape = (self.config.num_layers, self.max_loras)
                self.a[module] = torch.zeros(*shape, self.max_rank, fan_in, dtype=self.dtype, device=self.device)
                self.b[module] = torch.zeros(*shape, fan_out, self.max_rank, dtype=self.dtype, device=self.device)
            rank = a.shape[0]
            self.a[module][layer, slot, :rank].copy_(a)
            self.b[module][layer, slot, :, :rank].copy_(b)
            ranks[layer, module] = rank
        self.ranks[slot] = ranks
        self.scaling[slot] = adapter.scaling

    def begin_step(self, token_slots: Sequence[int] | None) -> None:
        """The slot of each row of the next forward (-1: the base model); None: no adapter row at all."""
        self.groups = []
        if token_slots is None:
            return
        rows_of: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                rows_of.setdefault(slot, []).append(row)
        for slot, rows in rows_of.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                self.groups.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                self.groups.append((slot, torch.tensor(rows, dtype=torch.long, device=self.device)))

    def add_deltas(self, layer: int, parts: Parts, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows, columns of each part] += (x[rows] A^T) B^T * scaling, for each slot of the step."""
        for slot, rows in self.groups:
            ranks = self.ranks[slot]
            if not any(ranks.get((layer, module)) for module, _, _ in parts):
                continue
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            for module, start, end in parts:
                rank = ranks.get((layer, module))
                if not rank:
                    continue
                a = self.a[module][layer, slot, :rank]
                b = self.b[module][layer, slot, :, :rank]
                delta = F.linear(F.linear(xs, a), b) * self.scaling[slot]
                columns = out[:, start:end]
                if isinstance(rows, slice):
                    columns[rows].add_(delta)
                else:
                    columns.index_add_(0, rows, delta)


class LoRALinear(nn.Module):
    """One of a layer's linears (fused or not), its output with the step's adapter deltas added."""

    def __init__(self, base: nn.Module, stack: LoRAStack, layer: int, parts: Parts) -> None:
        super().__init__()
        self.base = base
        self.stack = stack
        self.layer, self.parts = layer, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        if self.stack.groups:
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
