"""What start-up says once the model is loaded: one block a person reads to know what is running and why."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.engine.api import EngineDescription, KVCacheDescription


def native_kernels_status(config: EngineConfig) -> str:
    """'on: <target> (<why that target>)', saying where bf16 prefill attention runs on AMX tiles, or 'off: <why>'
    (the reasons pagoda.kernels.cpu_kernels returns None for, and the user's own)."""
    from pagoda.kernels import cpu_kernels, simd_target

    if not config.use_kernels:
        return "off: --no-use-kernels"
    if config.parallel.executor_backend == "mp":
        return "off: a model split across ranks runs the torch path (docs/parallelism.md)"
    if torch.device(config.device).type != "cpu":
        return f"off: they are CPU kernels, the model is on {config.device}"
    if os.environ.get("PAGODA_DISABLE_KERNELS") == "1":
        return "off: PAGODA_DISABLE_KERNELS=1"
    target, why = simd_target()
    if target is None:
        return f"off: {why}; torch path"
    kernels = cpu_kernels()
    if kernels is None:
        return f"off: the {target} kernels did not build or load (see the warning above); torch path"
    amx = ", bf16 prefill attention on AMX tiles" if kernels.prefill_attention_amx else ""
    return f"on: {target} ({why}){amx}"


def quantization_summary(config: EngineConfig, matmul: str | None = None) -> str:
    """'none', 'int8 ...', 'int4, group 32, ...' or what a GPTQ/AWQ checkpoint brings. matmul: what the model's
    quantized layers run (their `matmul_name`)."""
    from pathlib import Path

    from pagoda.int4_format import Int4Options
    from pagoda.model.prequantized import read_prequantized_format
    from pagoda.model_dir import read_json

    checkpoint = read_prequantized_format(read_json(Path(config.model) / "config.json"), config.model)
    if checkpoint is not None:
        groups = "one per row" if checkpoint.group_size == -1 else str(checkpoint.group_size)
        order = ", act-order" if checkpoint.desc_act else ""
        return f"int4 from the checkpoint ({checkpoint.method}, group {groups}{order}; {matmul})"
    if config.quantization == "int8":
        return f"int8 weight-only, per output channel; {matmul}"
    if config.quantization == "int4":
        options = config.quantization_config or Int4Options()
        kind = "symmetric" if options.sym else "with offsets"
        head = "LM head included" if options.lm_head else "LM head unquantized"
        return f"int4 weight-only, group {options.group_size}, {kind}, {head}; {matmul}"
    return "none"


def human_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def startup_summary(engine: EngineDescription, config: EngineConfig, model_name: str, url: str | None = None) -> str:
    """The block `pagoda serve` logs when it turns ready: what the engine says it is (`engine`), and what the
    configuration asked for that the engine does not describe (quantization options, kernels)."""
    kv = engine.kv_cache
    rows = [
        ("model", model_name if model_name == engine.model else f"{model_name} ({engine.model})"),
        ("parameters", human_count(engine.num_parameters)),
        ("dtype", engine.dtype),
        ("quantization", quantization_summary(config, engine.quantized_matmul)),
        ("KV cache", f"{kv_capacity(kv)}, {kv.dtype}, {kv.num_bytes / 2**20:.1f} MiB ({kv.sizing_reason}); "
                     "pages touched as they fill"),
        ("max_model_len", str(engine.max_model_len)),
        ("max_num_seqs", str(engine.max_num_seqs)),
        ("threads", threads_summary(engine)),
        ("native kernels", native_kernels_status(config)),
    ]
    if url is not None:
        rows.append(("URL", f"{url}  (OpenAI API under {url}/v1)"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def kv_capacity(kv: KVCacheDescription) -> str:
    """The pool's blocks and what they hold: tokens, or with KV cache groups (sliding windows), a group's layers
    each, and how many max_model_len sequences fit, the sliding groups holding only their windows."""
    if not kv.groups:
        return f"{kv.num_blocks} blocks x {kv.block_size} tokens = {kv.num_blocks * kv.block_size} tokens"
    return (f"{kv.num_blocks} blocks x {kv.block_size} tokens of one group's layers, {kv.groups}: "
            f"{kv.max_len_sequences} sequences of max_model_len at once")


def threads_summary(engine: EngineDescription) -> str:
    """The threads of each rank, and the ranks: tensor-parallel, in pipeline stages."""
    tensor, stages = engine.tensor_parallel_size, engine.pipeline_parallel_size
    if tensor * stages == 1:
        return str(engine.num_threads)
    split = f"{tensor} tensor-parallel ranks" if stages == 1 else (
        f"{tensor * stages} ranks ({stages} pipeline stages of {tensor} tensor-parallel rank{'s' * (tensor > 1)})")
    return f"{engine.num_threads} per rank x {split}"
