"""A local Hugging Face directory -> ModelConfig + weights on a device, in a dtype.

Reads config.json and *.safetensors (single file or sharded with an index); never pickle. Every
unsupported architecture, rope type or field fails here, naming the file or field.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from pagoda.config import DTYPE_BYTES, ModelConfig
from pagoda.int4_format import Int4Options
from pagoda.model.families import FAMILY_ARCHITECTURES, family_fields, per_layer_type_rope
from pagoda.model.rope_scaling import SUPPORTED_ROPE_TYPES
from pagoda.model_dir import ModelLoadError, read_json
from pagoda.moe_config import DENSE_FAMILY, MOE_ARCHITECTURES, MoEConfigError, read_moe_config

if TYPE_CHECKING:
    from pagoda.model.llama import LlamaModel
    from pagoda.model.parallel import TensorParallel
    from pagoda.model.pipeline import PipelineStage

# name -> the slice of it to read, (dimension, start, stop), or None for the whole tensor.
TensorSlicer = Callable[[str], "tuple[int, int, int] | None"]
# name -> whether to read it at all (a pipeline stage reads its own layers' tensors only).
TensorFilter = Callable[[str], bool]

# The torch dtype of each dtype name config holds (its names are torch's own).
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    **MOE_ARCHITECTURES,
    **FAMILY_ARCHITECTURES,
}
# The fields each scaled rope type needs besides rope_theta (transformers' names).
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                  "yarn": (), "dynamic": ("factor",), "longrope": ("short_factor", "long_factor")}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    hf = read_json(path)

    def need(field: str) -> Any:
        if field not in hf or hf[field] is None:
            raise ModelLoadError(f"{path}: required field {field!r} is missing")
        return hf[field]

    architectures = hf.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: field 'architectures' = {architectures!r} is not supported; "
            f"pagoda supports {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if arch not in FAMILY_ARCHITECTURES.values() and hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: field 'hidden_act' = {hf['hidden_act']!r} is not supported (only 'silu')")
    num_heads = need("num_attention_heads")
    hidden_size = need("hidden_size")
    num_layers = need("num_hidden_layers")
    family = DENSE_FAMILY.get(arch, arch)  # a mixture of experts' attention is its dense family's
    try:
        moe = read_moe_config(hf, arch, num_layers)
    except MoEConfigError as error:
        raise ModelLoadError(f"{path}: {error}") from error
    head_dim = hf.get("head_dim") or hidden_size // num_heads
    eos_ids = _eos_token_ids(hf, Path(model_dir) / "generation_config.json")
    config = ModelConfig(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=10000.0,  # and rope_scaling: `_rope_fields`
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=(family == "qwen2" and bool(hf.get("qkv_bias", True))) or bool(hf.get("attention_bias", False)),
        o_proj_bias=arch in ("llama", "qwen3_moe") and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_windows=_sliding_windows(hf, family, num_layers),
        eos_token_ids=eos_ids,
        bos_token_id=hf.get("bos_token_id"),
        moe=moe,
    )
    quirks = family_fields(hf, arch, path, num_layers) if arch in FAMILY_ARCHITECTURES.values() else {}
    return replace(config, **quirks, **_rope_fields(hf, path, arch, head_dim))


def _eos_token_ids(hf: dict[str, Any], generation_config: Path) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (chat models list their end-of-turn there)."""
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    if generation_config.is_file():
        sources.append(read_json(generation_config).get("eos_token_id"))
    for eos in sources:
        for token_id in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _rope_fields(hf: dict[str, Any], path: Path, arch: str, head_dim: int) -> dict[str, Any]:
    """rope_theta, rope_scaling, rotary_dim and (Gemma 3) sliding_rope."""
    per_layer_type = per_layer_type_rope(hf)
    if per_layer_type is not None:
        full, sliding = per_layer_type
        theta, scaling = _rope(full, hf, path, arch, head_dim)
        return {"rope_theta": theta, "rope_scaling": scaling, "sliding_rope": _rope(sliding, hf, path, arch, head_dim)}
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
    merged = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta, scaling = _rope(merged, hf, path, arch, head_dim)
    factor = float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ModelLoadError(f"{path}: field 'partial_rotary_factor' = {factor!r} leaves {rotary_dim} of head_dim "
                             f"{head_dim} rotated; pagoda needs an even count, the rest even too")
    if scaling is not None and scaling["rope_type"] == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != rotary_dim // 2:
                raise ModelLoadError(f"{path}: field 'rope_parameters' has {len(scaling[name])} {name}s; the rotary "
                                     f"dims ({rotary_dim}) need {rotary_dim // 2}")
    return {"rope_theta": theta, "rope_scaling": scaling, "rotary_dim": None if rotary_dim == head_dim else rotary_dim}


def _rope(params: dict[str, Any], hf: dict[str, Any], path: Path, arch: str,
          head_dim: int) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from one flat rope dict; scaling is None for plain rope, else the dict with `rope_type`
    and the model's (original_)max_position_embeddings, which the scaled types read."""
    field = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if arch == "phi3" and rope_type in ("su", "yarn"):  # transformers reads both as LongRoPE for Phi-3
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{path}: field {field!r} has rope type {rope_type!r}; pagoda supports {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    missing = [name for name in _ROPE_REQUIRED[rope_type] if params.get(name) is None]
    if missing:
        raise ModelLoadError(f"{path}: field {field!r} (rope type {rope_type!r}) lacks {missing}")
    scaling = {**params, "rope_type": rope_type, "max_position_embeddings": hf.get("max_position_embeddings", 2048)}
    if rope_type in ("llama3", "yarn", "longrope"):  # as transformers: the top-level field first (Phi-3 writes it)
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or scaling["max_position_embeddings"]
    return theta, scaling


def _sliding_windows(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if arch == "mistral":
            layer_types = ["sliding_attention"] * num_layers
        else:  # Qwen: layers from max_window_layers up use the window
            first = hf.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: field 'weight_map' is missing")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
        hint = f" (found {pickles}: pickle checkpoints are not loaded, convert to safetensors)" if pickles else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights{hint}")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: file not found (listed in the safetensors index)")
    return files


def iter_weights(model_dir: str | Path, slicer: TensorSlicer | None = None,
                 reads: TensorFilter | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor in the checkpoint, on CPU, in its stored dtype. slicer: which part
    of each tensor to read (a tensor-parallel rank's shard), read through safetensors' slices: only those bytes.
    reads: which tensors to read (a pipeline stage's); the others are not read at all."""
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if reads is not None and not reads(name):
                        continue
                    part = None if slicer is None else slicer(name)
                    if part is None:
                        yield name, reader.get_tensor(name)
                        continue
                    dim, start, stop = part
                    whole = reader.get_slice(name)
                    yield name, whole[start:stop] if dim == 0 else whole[:, start:stop]
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{file}: cannot read safetensors ({error})") from error


def checkpoint_num_parameters(model_dir: str | Path) -> int:
    """The checkpoint's parameter count, from the safetensors headers (no tensor is read)."""
    total = 0
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(reader.get_slice(name).get_shape())
    return total


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    quantization: str | None = None,
    use_kernels: bool = True,
    quantization_config: Int4Options | None = None,
    parallel: TensorParallel | None = None,
    pipeline: PipelineStage | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Builds the model for the directory and loads its weights. Returns (model, ModelConfig), the config being
    the whole model's even when the model is one rank's share.

    quantization: None, "int8" or "int4", applied at load; a GPTQ or AWQ checkpoint is int4 already (its own
    codes, repacked), and refuses the others. quantization_config: the int4 quantizer's options.
    use_kernels: pagoda's native CPU kernels where they apply (`backends.create_runtime` says where),
    for a model on the CPU; without them, or elsewhere, the torch reference throughout.
    parallel: this process's rank when the model is split across ranks (model/parallel.py): it builds and reads
    only its shard (quantized: its shard quantized, model/quantized_shards.py), and runs the torch reference but
    for the quantized linears' kernels (the native decode stack is one process's whole stack).
    pipeline: this process's pipeline stage (model/pipeline.py): it builds and reads only its layers (and the
    embedding on the first stage, the final norm and LM head on the last), and runs as a split model does."""
    from pagoda.kernels import avx2_kernels, cpu_kernels
    from pagoda.model.backends import create_runtime
    from pagoda.model.checkpoint_adapters import adapt_checkpoint, needs_adapting
    from pagoda.model.llama import LlamaModel
    from pagoda.model.native_decode import bind_decode_stack
    from pagoda.model.prequantized import read_prequantized_format
    from pagoda.model.quantization import prepare_linears

    config = load_model_config(model_dir)
    prequantized = read_prequantized_format(read_json(Path(model_dir) / "config.json"), model_dir)
    if prequantized is not None:
        _check_prequantized_request(model_dir, prequantized.method, quantization, quantization_config)
        quantization = "int4"
    if config.moe is not None:
        _check_moe_request(model_dir, prequantized is not None, parallel)
    slicer: TensorSlicer | None = None
    model_config = config
    reads: TensorFilter | None = None
    if parallel is not None:
        from pagoda.model.expert_parallel import expert_placement, expert_reads
        from pagoda.model.parallel import shard_config, shard_rows

        model_config = shard_config(config, parallel)
        slicer = partial(shard_rows, config=config, parallel=parallel)
        if quantization is not None or prequantized is not None:
            from pagoda.model.quantized_shards import quantized_slicer

            slicer = quantized_slicer(config, parallel, quantization, quantization_config, prequantized) or slicer
        if (placement := expert_placement(config, parallel)) is not None:
            reads = partial(expert_reads, placement=placement)
    if pipeline is not None:
        from pagoda.model.pipeline import stage_config, stage_reads

        model_config = stage_config(model_config, pipeline)
        in_stage = partial(stage_reads, config=config, stage=pipeline)
        reads = in_stage if reads is None else _both(reads, in_stage)
    # A split model runs the kernels as one process does: a tensor-parallel rank's shards are layers of its shapes
    # (its decode stack all-reduces o's and down's partial sums: native_decode.py), and a pipeline stage's layers
    # run through the modules' kernels (the decode stack runs a whole model: `bind_decode_stack` leaves a stage).
    native = use_kernels and torch.device(device).type == "cpu"
    kernels = cpu_kernels() if native else None
    # `create_runtime` decides which quantized layers take these; an unquantized model needs no AVX2 module.
    quantized_kernels = (kernels if kernels is not None else avx2_kernels()) if native and quantization else None
    runtime = create_runtime(model_config, dtype, kernels, quantization, quantized_kernels)
    runtime = replace(runtime, parallel=parallel, pipeline=pipeline)
    with torch.device("meta"):
        model = LlamaModel(model_config, runtime)
    weights = _with_progress(iter_weights(model_dir, slicer, reads), model_dir)
    if pipeline is not None:
        from pagoda.model.pipeline import stage_weights

        weights = stage_weights(weights, config, pipeline)
    if needs_adapting(config):  # fused projections split, partial rotary's q/k rows reordered (Phi-3)
        if prequantized is not None:
            raise ModelLoadError(f"{model_dir}: {prequantized.method} weights of {config.architecture} are not "
                                 "supported (its fused or partially rotated projections are reshaped on loading)")
        weights = adapt_checkpoint(weights, config, slicer)
    if prequantized is not None and parallel is not None:
        from pagoda.model.quantized_shards import rebase_g_idx

        weights = rebase_g_idx(weights, config, parallel, prequantized)
    if prequantized is None:
        model.load_weights(weights, dtype=dtype, device=device)
        prepare_linears(model, quantization, runtime.gemv_kernels, quantization_config, runtime.quantized_kernels)
    else:
        from pagoda.model.int4_checkpoint import load_prequantized

        load_prequantized(model, weights, prequantized, dtype, device, runtime.gemv_kernels,
                          runtime.quantized_kernels)
    bind_decode_stack(model)  # the weights are final: the native decode stack, where chosen, is built now
    return model.eval(), config


def _check_moe_request(model_dir: str | Path, prequantized: bool, parallel: TensorParallel | None) -> None:
    """What a mixture-of-experts model does not run yet is refused by name, not run wrong."""
    if prequantized:
        raise ModelLoadError(f"{model_dir}: GPTQ/AWQ mixture-of-experts checkpoints are not loaded; load the "
                             "unquantized checkpoint with --quantization int8 or int4")
    if parallel is not None and not parallel.expert_parallel:
        raise ModelLoadError(f"{model_dir}: a mixture-of-experts model splits across tensor_parallel_size "
                             f"{parallel.world_size} ranks with --enable-expert-parallel (enable_expert_parallel=True: "
                             "each rank holds some experts whole); its experts are not sliced tensor-parallel")


def _both(first: TensorFilter, second: TensorFilter) -> TensorFilter:
    return lambda name: first(name) and second(name)


def _check_prequantized_request(model_dir: str | Path, method: str, quantization: str | None,
                                options: Int4Options | None) -> None:
    """A GPTQ/AWQ checkpoint fixes its own quantization: another one asked for is an error, not ignored."""
    if quantization not in (None, "int4"):
        raise ModelLoadError(f"{model_dir} holds {method} 4-bit weights; --quantization {quantization} cannot "
                             "apply to them (leave it out, or give int4)")
    if options is not None:
        raise ModelLoadError(f"{model_dir} holds {method} 4-bit weights, quantized with the checkpoint's own "
                             "settings; --quantization-config applies only when pagoda quantizes")


def _with_progress(
    weights: Iterator[tuple[str, torch.Tensor]], model_dir: str | Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, with a progress bar in checkpoint bytes on stderr when it is a terminal (logs stay clean)."""
    if not sys.stderr.isatty():
        yield from weights
        return
    from tqdm import tqdm  # type: ignore[import-untyped]

    total = sum(file.stat().st_size for file in safetensors_files(model_dir))
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", file=sys.stderr) as bar:
        for name, tensor in weights:
            bar.update(tensor.numel() * tensor.element_size())
            yield name, tensor
