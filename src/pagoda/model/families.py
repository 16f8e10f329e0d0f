"""The families beyond the Llama layout, read from config.json into ModelConfig's fields: Gemma 2, Gemma 3 (text),
OLMo 2 and Phi-3 / Phi-4-mini. Each quirk is a field the one implementation (model/llama.py) honours; a value this
code does not implement is refused, naming the field, as the loader refuses the others.

- Gemma 2: GeGLU, norms before and after each sublayer scaling by (1 + weight), embeddings times sqrt(hidden),
  q·k scaled by query_pre_attn_scalar**-0.5, attention and final logits soft-capped, sliding-window layers as
  `layer_types` says (every other layer).
- Gemma 3: as Gemma 2 without soft-capped attention (transformers ignores attn_logit_softcapping there), with
  per-head q/k norms (1 + weight) and the local layers' own rope (`rope_local_base_freq`, or the
  `sliding_attention` entry of rope_parameters); the global layers take rope_theta and any scaling.
- OLMo 2: norms after attention and after the MLP only (on the sublayer's output), q and k normed over the whole
  projection, not per head; its norms multiply in fp32.
- Phi-3 / Phi-4-mini: q/k/v and gate/up fused in the checkpoint (model/checkpoint_adapters.py splits them),
  partial rotary (`partial_rotary_factor`), LongRoPE, an optional sliding window on every layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.model_dir import ModelLoadError

FAMILY_ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
}
GELU_TANH = "gelu_pytorch_tanh"
# transformers' defaults for fields a Gemma config.json may leave out (its config classes').
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_THETA = 10000.0


def _refuse(path: Path, field: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: field {field!r} = {value!r} is not supported ({supported})")


def family_fields(hf: dict[str, Any], arch: str, path: Path, num_layers: int) -> dict[str, Any]:
    """ModelConfig's fields for a family architecture, beyond those every family reads alike (sizes, eps, eos),
    rope excepted (`rope_fields`)."""
    if arch in ("gemma2", "gemma3"):
        return _gemma(hf, arch, path, num_layers)
    if arch == "olmo2":
        _require_silu(hf, path)
        bias = bool(hf.get("attention_bias", False))
        return {"attention_bias": bias, "o_proj_bias": bias, "qk_norm": True, "qk_norm_per_head": False,
                "norm_placement": "post", "sliding_windows": (None,) * num_layers}
    if arch == "phi3":
        _require_silu(hf, path)
        window = hf.get("sliding_window")  # every layer's, when set (transformers' Phi3Model)
        return {"sliding_windows": (window,) * num_layers}
    raise AssertionError(f"not a family architecture: {arch}")


def _require_silu(hf: dict[str, Any], path: Path) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", hf["hidden_act"], "only 'silu'")


def _gemma(hf: dict[str, Any], arch: str, path: Path, num_layers: int) -> dict[str, Any]:
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if activation != GELU_TANH:
        raise _refuse(path, "hidden_activation", activation, f"only {GELU_TANH!r}")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(path, "use_bidirectional_attention", True, "causal attention only")
    hidden, bias = hf["hidden_size"], bool(hf.get("attention_bias", False))
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern") or _GEMMA_SLIDING_PATTERN[arch]
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in layer_types:
        raise ModelLoadError(f"{path}: field 'sliding_window' is missing (layer_types has sliding layers)")
    return {
        "hidden_act": GELU_TANH,
        "norm_placement": "sandwich",
        "norm_unit_offset": True,
        "attention_bias": bias,
        "o_proj_bias": bias,
        "qk_norm": arch == "gemma3",
        "embedding_multiplier": hidden**0.5,
        "attention_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcapping": hf.get("attn_logit_softcapping") if arch == "gemma2" else None,
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "sliding_windows": tuple(window if kind == "sliding_attention" else None for kind in layer_types),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def per_layer_type_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Gemma 3's rope settings as (full layers', sliding layers') flat dicts in config.json's spelling, or None for
    a model with one rope. transformers >= 5 nests them in rope_parameters by layer type; older configs give
    rope_theta (+ rope_scaling) for the global layers and rope_local_base_freq for the local ones."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
        sliding.setdefault("rope_theta", _GEMMA3_LOCAL_THETA)
        return full, sliding
    if hf.get("architectures") and "Gemma3ForCausalLM" in hf["architectures"]:
        full = {**(hf.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        return full, {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA)}
    return None
