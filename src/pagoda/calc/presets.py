"""Named GPUs and models, and how a `--gpu` / `--model` argument is resolved to one of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.calc.shapes import (
    GpuSpec,
    ModelShape,
    params_only,
    parse_param_count,
    shape_from_hf_config,
    shape_from_path,
)

# Dense bf16 tensor-core TFLOP/s (NVIDIA's headline figures are often 2:4-sparse: twice these), HBM
# TB/s, capacity in datasheet GB, and per-direction NVLink / PCIe GB/s (half the bidirectional figure).
# The per-hop all-reduce latency is an assumption, not a datasheet figure: small-message all-reduces on
# NVLink take some microseconds per ring hop once launch overheads are counted, and more across PCIe.
NVLINK_HOP_US = 1.5
PCIE_HOP_US = 4.0
GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name.lower().replace(" ", "-"): spec
    for spec in (
        GpuSpec("H100 SXM", peak_tflops=989.0, bandwidth_tbps=3.35, memory_gb=80, interconnect_gbps=450,
                interconnect_latency_us=NVLINK_HOP_US),
        GpuSpec("H200", peak_tflops=989.0, bandwidth_tbps=4.8, memory_gb=141, interconnect_gbps=450,
                interconnect_latency_us=NVLINK_HOP_US),
        GpuSpec("B200", peak_tflops=2250.0, bandwidth_tbps=7.7, memory_gb=180, interconnect_gbps=900,
                interconnect_latency_us=NVLINK_HOP_US),
        GpuSpec("A100 80GB", peak_tflops=312.0, bandwidth_tbps=2.039, memory_gb=80, interconnect_gbps=300,
                interconnect_latency_us=NVLINK_HOP_US),
        GpuSpec("L4", peak_tflops=121.0, bandwidth_tbps=0.3, memory_gb=24, interconnect_gbps=32,
                interconnect_latency_us=PCIE_HOP_US),
        GpuSpec("RTX PRO 6000", peak_tflops=503.8, bandwidth_tbps=1.792, memory_gb=96, interconnect_gbps=64,
                interconnect_latency_us=PCIE_HOP_US),
    )
}

# Names that mean "measure the machine we are running on".
THIS_MACHINE = ("this-machine", "this", "local", "measured")


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int,
           **extra: Any) -> dict[str, Any]:
    """An HF config.json for the Llama family, so presets and files share one parameter count."""
    config = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": mlp,
        "tie_word_embeddings": False,
    }
    return config | extra


MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _llama(128256, 4096, 32, 32, 8, 14336),
    "llama-3-70b": _llama(128256, 8192, 80, 64, 8, 28672),
    "llama-3.1-405b": _llama(128256, 16384, 126, 128, 8, 53248),
    "mistral-7b": _llama(32000, 4096, 32, 32, 8, 14336),
    "qwen2.5-7b": _llama(152064, 3584, 28, 28, 4, 18944, model_type="qwen2"),
    "qwen2.5-72b": _llama(152064, 8192, 80, 64, 8, 29568, model_type="qwen2"),
    # The project's benchmark models (scripts/make_bench_models.py): tied embeddings, vocab 32000.
    "bench-125m": _llama(32000, 576, 30, 9, 3, 1536, tie_word_embeddings=True),
    "bench-1b": _llama(32000, 2048, 22, 32, 4, 5632, tie_word_embeddings=True),
}


def _normalise(name: str) -> str:
    return name.strip().lower().replace(" ", "-").replace("_", "-")


def resolve_gpu(name: str) -> GpuSpec:
    key = _normalise(name)
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    known = ", ".join([*GPU_PRESETS, THIS_MACHINE[0]])
    raise ValueError(f"unknown GPU {name!r}; known: {known} (or give --tflops and --tbps)")


def resolve_model(spec: str) -> ModelShape:
    """A preset name, a config.json (or the directory holding it), or a bare count like '70B'."""
    key = _normalise(spec)
    if key in MODEL_CONFIGS:
        return shape_from_hf_config(MODEL_CONFIGS[key], key)
    path = Path(spec)
    if path.exists():
        return shape_from_path(path)
    count = parse_param_count(spec)
    if count is not None:
        return params_only(spec, count)
    known = ", ".join(MODEL_CONFIGS)
    raise ValueError(f"unknown model {spec!r}: not a preset ({known}), a config.json, or a count like 70B")
