"""A GPTQ or AWQ checkpoint into a LlamaModel: its 4-bit layers become Int4Linear, from the checkpoint's own
codes (never dequantized and quantized again); everything else loads as from any checkpoint.

The quantized layers' weights never exist in full precision: before the model's memory is allocated, each
linear the checkpoint quantizes is swapped for a placeholder that holds only its bias, so the loader fills
biases, norms and embeddings as usual while the 4-bit parts are set aside, then fused (q/k/v, gate/up) in
pagoda's row order and installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.model.int4 import Int4Linear
from pagoda.model.int4_weights import Int4Weights, stack_outputs
from pagoda.model.parallel import QuantizedRowParallel, RowParallelLinear, TensorParallel
from pagoda.model_dir import ModelLoadError

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels, QuantizedKernels
    from pagoda.model.llama import LlamaModel
    from pagoda.model.prequantized import PrequantizedFormat

# Checkpoint projection -> (our module, the fused module's part).
_FUSED_PARTS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


class PendingInt4(nn.Module):
    """Stands in for a linear whose 4-bit weights are being read: only its bias takes memory."""

    def __init__(self, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias), requires_grad=False)


def load_prequantized(model: LlamaModel, weights: Iterable[tuple[str, torch.Tensor]], fmt: PrequantizedFormat,
                      dtype: torch.dtype, device: str | torch.device, kernels: CpuKernels | None,
                      quantized_kernels: QuantizedKernels | None = None) -> None:
    from pagoda.model.prequantized import iter_prequantized
    from pagoda.model.quantization import DenseLinear

    targets = _quantized_modules(model, fmt.lm_head)
    row_parallel: dict[str, TensorParallel] = {}  # the layers whose shards' partial sums are all-reduced
    for path in targets:
        linear = model.get_submodule(path)
        assert isinstance(linear, nn.Linear)
        if isinstance(linear, RowParallelLinear):
            row_parallel[path] = linear.parallel
        _set_module(model, path, PendingInt4(linear.bias))
    parts: dict[str, dict[str, Int4Weights]] = {path: {} for path in targets}
    model.load_weights(_set_aside(iter_prequantized(weights, fmt), model, parts), dtype=dtype, device=device)
    for path, pieces in parts.items():
        pending = model.get_submodule(path)
        assert isinstance(pending, PendingInt4)
        try:
            if path in row_parallel:  # the bias is added once, after the all-reduce
                layer: nn.Module = QuantizedRowParallel(Int4Linear(_fuse(model, path, pieces), None, quantized_kernels),
                                                        pending.bias, row_parallel[path])
            else:
                layer = Int4Linear(_fuse(model, path, pieces), pending.bias, quantized_kernels)
        except ValueError as error:  # a layout pagoda's int4 layer cannot take: name the layer
            raise ModelLoadError(f"{path}: {error}") from error
        _set_module(model, path, layer)
    if not fmt.lm_head and kernels is not None and dtype in DenseLinear.DTYPES and model.lm_head is not None:
        _set_module(model, "lm_head", DenseLinear(model.lm_head, kernels))


def _quantized_modules(model: LlamaModel, lm_head: bool) -> list[str]:
    """Our module paths whose weights a quantized checkpoint stores as 4-bit codes."""
    paths = [f"layers.{i}.{sub}" for i in range(model.config.num_layers)
             for sub in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    return paths + (["lm_head"] if lm_head else [])


def _set_aside(weights: Iterable[tuple[str, torch.Tensor | Int4Weights]], model: LlamaModel,
               parts: dict[str, dict[str, Int4Weights]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain tensors, for the model's loader; each 4-bit layer is kept in `parts` under our module."""
    for name, value in weights:
        if not isinstance(value, Int4Weights):
            yield name, value
            continue
        path, part = _our_module(name.removeprefix("model.").removesuffix(".weight"))
        if path not in parts:
            raise ValueError(f"4-bit tensor {name!r} is not one of this model's quantized linears")
        parts[path][part] = value


def _our_module(checkpoint_path: str) -> tuple[str, str]:
    """layers.0.self_attn.k_proj -> (layers.0.self_attn.qkv_proj, k); unfused layers are their own part."""
    parent, _, leaf = checkpoint_path.rpartition(".")
    if leaf in _FUSED_PARTS:
        fused, part = _FUSED_PARTS[leaf]
        return f"{parent}.{fused}", part
    return checkpoint_path, leaf


def _fuse(model: LlamaModel, path: str, pieces: dict[str, Int4Weights]) -> Int4Weights:
    module = path.rpartition(".")[2]
    offsets = model.fused_rows.get(module)
    order = sorted(offsets, key=offsets.__getitem__) if offsets else [module]
    missing = [part for part in order if part not in pieces]
    if missing:
        raise ValueError(f"checkpoint is missing the 4-bit weights of {path} ({', '.join(missing)})")
    return stack_outputs([pieces[part] for part in order])


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
