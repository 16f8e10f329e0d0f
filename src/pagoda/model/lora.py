"""Batched LoRA: the rows of several adapters and of the base model in one step, on the base's fused projections.

Adapters live in stacked tensors, one slot each (`LoRAStack`: per projection, A `[layers, slots, max_rank, in]` and
B transposed, `[layers, slots, max_rank, out]`, a slot's entries beyond its adapter's rank and in the projections it
does not target being zero); the caller loads an adapter into a slot (`load`) and, before each forward, says which
slot each token's row uses (`begin_step`: -1 for the base). Each of a layer's four linears is wrapped
(`LoRALinear`): the base output first, then for each projection an adapter of the step targets, every row's
`(x A^T) B^T * scaling` added to that projection's columns inside the fused output (q/k/v in qkv_proj, gate/up
in gate_up_proj; a Phi-3 adapter's qkv_proj or gate_up_proj: all of them, the checkpoint's fused order being
ours). Two ways, by the number of rows, as the base linears choose theirs:
- Decode-sized inputs (where the native decode stack runs, up to its row bound) go through the kernels'
  `lora_add_`: each row reads only its own slot's A and B, so an adapter row costs its rank in bytes, and there
  is no matmul dispatch per projection. The native stack calls the same kernel inside its one call
  (`AdapterDecode`: it is handed views of the stacked tensors once per module and each step's rows), so decode
  steps with adapter rows keep the stack and give the modules' output bit for bit.
- Larger inputs (prefill chunks) go in one pair of matmuls per projection, whatever the mix of adapters: x
  against every slot's A at once, each row's products outside its own slot's block masked to zero (an exact zero),
  then against every slot's B, the row scaled by its adapter's scaling; the price is the other slots' rank in
  flops, small beside the base projection at these sizes.
Both compute what PEFT does, `W x + B(A x) * scaling`, up to the order of rounding.

Under tensor parallelism each rank's stack holds its share of every adapter (`parallel.shard_lora_module`): the
rows of B its column-parallel projections compute, the columns of A its row-parallel ones read. There the shrink
x A^T is a partial sum, added up across the ranks (a [rows, slots * max_rank] all-reduce) before B, so every
rank adds the whole delta after the base's own all-reduce. Split models run no native decode stack, so their
deltas are the matmuls'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelConfig
from pagoda.model.attention import AttentionMetadata
from pagoda.model.kv_cache import LayerKV
from pagoda.model.lora_checkpoint import LoRAAdapter, module_shape
from pagoda.model.native_decode import NativeDecode
from pagoda.model.parallel import ROW_PARALLEL_PROJECTIONS, TensorParallel, shard_lora_module

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels
    from pagoda.model.layers import GatedMLP
    from pagoda.model.llama import DecoderLayer, LlamaModel, RopeTables

# (PEFT module, first column, end column) inside one of our linears' output.
Parts = tuple[tuple[str, int, int], ...]


class LoRAStack:
    """Every slot's adapter weights, and which rows of the current step use which slot."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: CpuKernels | None = None, kernel_max_rows: int = 0,
                 parallel: TensorParallel | None = None, base_config: ModelConfig | None = None) -> None:
        """kernels: the compiled kernels whose `lora_add_` takes inputs of up to `kernel_max_rows` rows (the native
        decode stack's bound, so that its steps and the modules' agree); None: torch's matmuls for every input.
        parallel: this rank's place when the model is split (config: its share; base_config: the whole model's,
        whose shapes adapters have; None: config)."""
        assert parallel is None or kernels is None, "a split model's deltas are the matmuls' (no native stack)"
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.parallel, self.base_config = parallel, base_config or config
        self.dtype, self.device = dtype, device
        self.kernels = kernels if dtype in (torch.float32, torch.bfloat16) else None
        self.kernel_max_rows = kernel_max_rows
        # Per PEFT module, allocated when an adapter first targets it (zeros: what no adapter holds adds nothing).
        self.a: dict[str, torch.Tensor] = {}
        self.bt: dict[str, torch.Tensor] = {}  # B transposed: each slot's rank rows of out contiguous
        self.modules_of: list[set[str]] = [set() for _ in range(max_loras)]  # the modules each slot's adapter targets
        self.scaling = [0.0] * max_loras
        self.targeted: set[str] = set()  # the current step's adapters' modules; empty: a base-only step
        self.row_slots = torch.zeros(0, dtype=torch.long)  # [rows]: each row's slot, -1 for a base row
        self.row_scaling = torch.zeros(0)  # [rows] fp32: each row's adapter's scaling (0 for a base row)
        # The masked matmuls' [rows, slots * max_rank] mask and [rows, 1] scaling, made when a step first needs them.
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        """Whether the current step has adapter rows."""
        return bool(self.targeted)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts `adapter` in `slot`, replacing what the slot held (all of it: the masked matmuls read every entry)."""
        for module in self.a:
            self.a[module][:, slot].zero_()
            self.bt[module][:, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            if self.parallel is not None:
                a, b = shard_lora_module(module, a, b, self.base_config, self.parallel)
            if module not in self.a:
                fan_in, fan_out = module_shape(self.config, module)
                layers, slots, rank = self.config.num_layers, self.max_loras, self.max_rank
                self.a[module] = torch.zeros(layers, slots, rank, fan_in, dtype=self.dtype, device=self.device)
                self.bt[module] = torch.zeros(layers, slots, rank, fan_out, dtype=self.dtype, device=self.device)
            rank = a.shape[0]
            self.a[module][layer, slot, :rank].copy_(a)
            self.bt[module][layer, slot, :rank].copy_(b.t())
        self.modules_of[slot] = {module for _, module in adapter.weights}
        self.scaling[slot] = adapter.scaling

    def begin_step(self, token_slots: Sequence[int] | None) -> None:
        """The slot of each row of the next forward (-1: the base model); None: no adapter row at all."""
        self.targeted = set()
        slots = {slot for slot in token_slots or () if slot >= 0}
        if not slots:
            return
        self.targeted = set().union(*(self.modules_of[slot] for slot in slots))
        self.row_slots = torch.tensor(token_slots, dtype=torch.long)
        self.row_scaling = torch.tensor(self.scaling + [0.0], dtype=torch.float32)[self.row_slots]  # -1: the 0
        self._dense = None

    def _dense_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's mask (1 in each row's own slot's block, 0 elsewhere) and scaling column, in the stack's dtype."""
        if self._dense is None:
            rows = self.row_slots
            adapter_rows = rows >= 0
            mask = torch.zeros(len(rows), self.max_loras, self.max_rank, dtype=self.dtype)
            mask[adapter_rows, rows[adapter_rows]] = 1
            self._dense = (mask.view(len(rows), -1).to(self.device),
                           self.row_scaling.to(self.dtype).unsqueeze(1).to(self.device))
        return self._dense

    def add_deltas(self, layer: int, parts: Parts, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, columns of each part] += (x A^T) B^T * scaling, each row with its own slot's A, B and scaling."""
        kernels = self.kernels if x.shape[0] <= self.kernel_max_rows and x.dtype == self.dtype else None
        for module, start, end in parts:
            if module not in self.targeted:
                continue
            a, bt = self.a[module][layer], self.bt[module][layer]  # [slots, max_rank, in], [slots, max_rank, out]
            if kernels is not None:
                kernels.lora_add_(out[:, start:end], x.contiguous(), a, bt, self.row_slots, self.row_scaling)
                continue
            mask, scaling = self._dense_rows()
            shrunk = F.linear(x, a.view(-1, x.shape[-1])) * mask  # [rows, slots * max_rank]
            if self.parallel is not None and module in ROW_PARALLEL_PROJECTIONS:
                self.parallel.all_reduce(shrunk)  # each rank's columns of x: a partial sum
            out[:, start:end].add_(shrunk @ bt.view(-1, end - start) * scaling)


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


# The PEFT modules an adapter may target, numbered for the native stack; and its linears, in its order.
MODULE_IDS = {name: index for index, name in enumerate(
    ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"))}
STACK_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class AdapterDecode:
    """The backend's decode runner with adapters: the native stack, given each adapter module's A and B transposed
    (views of the `LoRAStack`'s tensors, handed over when a module's tensors first exist) and each step's rows."""

    def __init__(self, inner: NativeDecode, stack: LoRAStack, layers: list[tuple[LoRALinear, ...]]) -> None:
        self.inner, self.stack = inner, stack
        self.layers = layers  # each layer's wrapped linears, in STACK_LINEARS' order
        self._handed_over: set[str] = set()  # the modules whose parts the native stack holds

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        # Under tensor parallelism o's and down's shrinks are partial sums, all-reduced before B (LoRAStack);
        # the stack's lora_add_ shrinks and expands in one kernel, so adapter rows run through the modules.
        if self.stack.active and self.stack.parallel is not None:
            return False
        return self.inner.takes(meta, num_tokens)

    def _hand_over(self) -> None:
        for module in set(self.stack.a) - self._handed_over:
            for index, linears in enumerate(self.layers):
                a, bt = self.stack.a[module][index], self.stack.bt[module][index]
                for position, linear in enumerate(linears):
                    for name, start, end in linear.parts:
                        if name == module:
                            self.inner.stack.add_lora_part(index, position, MODULE_IDS[name], start, end, a, bt)
            self._handed_over.add(module)

    def __call__(self, x: torch.Tensor, ropes: list[RopeTables], kv_caches: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:
        if not self.stack.active:
            return self.inner(x, ropes, kv_caches, meta)
        self._hand_over()
        return self.inner.forward_lora(x, ropes, kv_caches, meta, self.stack.row_slots, self.stack.row_scaling,
                                       [MODULE_IDS[name] for name in self.stack.targeted])


def attach_lora(model: LlamaModel, max_loras: int, max_rank: int, base_config: ModelConfig | None = None
                ) -> LoRAStack:
    """Wraps the model's q/k/v/o/gate/up/down linears with `max_loras` adapter slots of rank up to `max_rank`.
    Called once the weights are final (after `load_model`): the linears wrapped are the prepared ones. A tensor-
    parallel rank's model gives `base_config`, the whole model's architecture; a pipeline stage is refused."""
    if model.embed_tokens is None or model.norm is None:
        raise ValueError("LoRA adapters are not served on a pipeline stage yet")
    if model.parallel is not None and base_config is None:
        raise ValueError("a tensor-parallel rank's adapters need the whole model's config")
    if model.config.moe is not None:
        raise ValueError("LoRA adapters are not served on a mixture-of-experts model yet")
    config = model.config
    runner = model.backend.decode_runner
    assert runner is None or isinstance(runner, NativeDecode), "the native stack is the one decode runner"
    # Under tensor parallelism the deltas are the matmuls' (the row-parallel shrinks are all-reduced before B),
    # and steps with adapter rows run through the modules (`AdapterDecode.takes`).
    kernel_runner = None if model.parallel is not None else runner
    stack = LoRAStack(config, max_loras, max_rank, model.dtype, next(model.parameters()).device,
                      None if kernel_runner is None else kernel_runner.kernels,
                      0 if kernel_runner is None else kernel_runner.max_rows, model.parallel, base_config)
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    wrapped: list[tuple[LoRALinear, ...]] = []  # each layer's, in STACK_LINEARS' order
    for index, layer in enumerate(cast("list[DecoderLayer]", list(model.layers))):
        attention, mlp = layer.self_attn, cast("GatedMLP", layer.mlp)
        # Both layouts' parts: an adapter targets the split projections or (Phi-3) the fused ones, never both,
        # and a part no adapter of the step targets costs nothing.
        linears = (
            LoRALinear(attention.qkv_proj, stack, index, (
                ("q_proj", 0, q_size), ("k_proj", q_size, q_size + kv_size),
                ("v_proj", q_size + kv_size, q_size + 2 * kv_size), ("qkv_proj", 0, q_size + 2 * kv_size))),
            LoRALinear(attention.o_proj, stack, index, (("o_proj", 0, config.hidden_size),)),
            LoRALinear(mlp.gate_up_proj, stack, index, (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter),
                                                        ("gate_up_proj", 0, 2 * inter))),
            LoRALinear(mlp.down_proj, stack, index, (("down_proj", 0, config.hidden_size),)),
        )
        # add_module replaces the child in place: the modules call it by the same attribute.
        for name, linear in zip(STACK_LINEARS, linears):
            (attention if name in ("qkv_proj", "o_proj") else mlp).add_module(name, linear)
        wrapped.append(linears)
    if runner is not None:
        model.backend.decode_runner = AdapterDecode(runner, stack, wrapped)
    return stack
