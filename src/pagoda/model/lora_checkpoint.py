"""A PEFT LoRA adapter directory -> `LoRAAdapter`, checked against the base model.

Reads adapter_config.json and adapter_model.safetensors (never pickle). What the batched LoRA layers
(model/lora.py) compute is `W x + (B A x) * scaling` on q/k/v/o/gate/up/down (Phi-3: on its fused qkv and gate_up,
which PEFT targets as whole modules, and o/down), with scaling lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)), as PEFT's `Linear` does. Every adapter feature that would change that formula
(DoRA, biases, modules_to_save, embedding or LM-head targets, per-module ranks) is refused here, by name: an
adapter either runs exactly or does not load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagoda.config import ModelConfig
from pagoda.model.checkpoint_adapters import rotary_row_order

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target (PEFT's names: the modules of the Hugging Face model), and the block each
# belongs to. Phi-3's checkpoint fuses q/k/v and gate/up, so its adapters target the fused modules.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
FUSED_TARGET_MODULES = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_(A|B)\.weight")
# Config fields whose non-empty value changes what a layer computes, and what each one is.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on parameters, not modules)",
    "trainable_token_indices": "trainable_token_indices (embedding rows)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "arrow_config": "Arrow routing (arrow_config)",
}


class LoRALoadError(ValueError):
    """An adapter that cannot be served: the message names the adapter, and the file or field at fault."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights, fp32 on the CPU, as PEFT stores them: per (layer, module) A [r, in] and B [out, r]."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def target_modules(config: ModelConfig) -> dict[str, str]:
    """The modules an adapter of this base model may target (PEFT's names), each with its block."""
    return FUSED_TARGET_MODULES if config.architecture == "phi3" else TARGET_MODULES


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(input features, output features) of a projection of the base model."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv_proj": (config.hidden_size, q_size + 2 * kv_size),
        "gate_up_proj": (config.hidden_size, 2 * config.intermediate_size),
        "q_proj": (config.hidden_size, q_size), "k_proj": (config.hidden_size, kv_size),
        "v_proj": (config.hidden_size, kv_size), "o_proj": (q_size, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }[module]


def load_lora_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks the adapter at `path` for a base model of `config`; LoRALoadError names what is wrong."""
    directory = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    if not directory.is_dir():
        raise LoRALoadError(f"{where}: not a directory")
    settings = _read_config(directory / CONFIG_FILE, where)
    rank, alpha = _check_config(settings, where, max_rank, config)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        hint = (f" (found {', '.join(pickles)}: pickle files are not loaded; save the adapter with safetensors, "
                "PEFT's default)") if pickles else ""
        raise LoRALoadError(f"{where}: {WEIGHTS_FILE} is missing{hint}")
    weights = _read_weights(weights_path, where, config, rank)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return LoRAAdapter(str(path), rank, scaling, weights)


def _read_config(path: Path, where: str) -> dict[str, Any]:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRALoadError(f"{where}: cannot read {CONFIG_FILE} ({error})") from None
    if not isinstance(settings, dict):
        raise LoRALoadError(f"{where}: {CONFIG_FILE} is not a JSON object")
    return settings


def _check_config(settings: dict[str, Any], where: str, max_rank: int, config: ModelConfig) -> tuple[int, float]:
    """(r, lora_alpha), once every field is one pagoda computes exactly."""
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRALoadError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for field, feature in _UNSUPPORTED_FIELDS.items():
        if settings.get(field):
            raise LoRALoadError(f"{where}: {feature} is not supported")
    bias = settings.get("bias", "none")
    if bias != "none":
        raise LoRALoadError(f"{where}: bias {bias!r} is not supported (only \"none\")")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRALoadError(f"{where}: field 'r' must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRALoadError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRALoadError(f"{where}: field 'lora_alpha' must be a number, got {alpha!r}")
    targets = settings.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    # A string other than a module name is PEFT's regex over module paths: the tensors then say what is targeted.
    for name in names if isinstance(targets, list) else []:
        _check_target(str(name), where, config)
    return rank, float(alpha)


def _check_target(name: str, where: str, config: ModelConfig) -> None:
    supported = target_modules(config)
    if name in supported or name == "all-linear":
        return
    listed = ", ".join(supported)
    if name in ("embed_tokens", "lm_head") or "embed" in name:
        raise LoRALoadError(f"{where}: target module {name!r} is not supported (embedding and LM-head adapters "
                            f"are not); supported: {listed}")
    if name in TARGET_MODULES or name in FUSED_TARGET_MODULES:  # the other layout's name
        raise LoRALoadError(f"{where}: target module {name!r} is not a module of this {config.architecture} model "
                            f"(the adapter was made for another architecture); supported: {listed}")
    raise LoRALoadError(f"{where}: unknown target module {name!r}; supported: {listed}")


def _read_weights(path: Path, where: str, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layer, module, half = _tensor_place(name, where, config)
                halves.setdefault((layer, module), {})[half] = reader.get_tensor(name).float()
    except (SafetensorError, OSError) as error:
        raise LoRALoadError(f"{where}: cannot read {WEIGHTS_FILE} ({error})") from None
    if not halves:
        raise LoRALoadError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRALoadError(f"{where}: layer {layer} {module} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = module_shape(config, module)
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRALoadError(
                f"{where}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"model's {module} ({fan_in} -> {fan_out}) at rank {rank} needs ({rank}, {fan_in}) and "
                f"({fan_out}, {rank}): the adapter does not fit this model")
        weights[layer, module] = (a.contiguous(), _model_row_order(b, module, config).contiguous())
    return weights


def _model_row_order(b: torch.Tensor, module: str, config: ModelConfig) -> torch.Tensor:
    """B's output rows in the order of the model's projection: the loader reorders q and k rows for partial
    rotary (checkpoint_adapters), so an adapter's q and k rows move with them (in Phi-3's fused qkv too)."""
    if module in ("q_proj", "k_proj"):
        return rotary_row_order(b, config)
    if module == "qkv_proj":
        kv_size = config.num_kv_heads * config.head_dim
        q, k, v = torch.split(b, [config.num_heads * config.head_dim, kv_size, kv_size])
        return torch.cat([rotary_row_order(q, config), rotary_row_order(k, config), v])
    return b


def _tensor_place(name: str, where: str, config: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A" | "B") of an adapter tensor; anything else is refused by what it is."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None:
        if "embed" in name or "lm_head" in name:
            what = "an embedding or LM-head adapter"
        elif "magnitude" in name:
            what = "a DoRA magnitude"
        elif name.endswith(".bias"):
            what = "a bias"
        else:
            what = "not a LoRA weight of q/k/v/o/gate/up/down"
        raise LoRALoadError(f"{where}: tensor {name!r} is not supported ({what})")
    layer_text, block, module, half = match.groups()
    layer = int(layer_text)
    if target_modules(config).get(module) != block:
        raise LoRALoadError(f"{where}: tensor {name!r}: target module {module!r} is not one of this "
                            f"{config.architecture} model's ({', '.join(target_modules(config))})")
    if layer >= config.num_layers:
        raise LoRALoadError(f"{where}: tensor {name!r} is for layer {layer}; the base model has "
                            f"{config.num_layers} layers: the adapter does not fit this model")
    return layer, module, half
