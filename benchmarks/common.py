"""Shared helpers for benchmarks/roofline.py, peers.py and step_profile.py.

Configs, environment capture (torch threads, `lscpu` model, load average), medians, the matmul rate at the
model's GEMM shapes (the streaming-read bandwidth is bandwidth.py's), byte and FLOP counts of a step, and one
instrumented engine loop that times every LLMEngine.step().
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import write_result


def _int8_activations() -> str:
    """bf16 where the CPU computes in bf16 (AVX-512 BF16), else fp32: elsewhere bf16 arithmetic is emulated, ~10x
    slower, and the int8 kernel quantizes x to int8 by itself."""
    from pagoda.kernels import cpu_flags

    return "bfloat16" if "avx512_bf16" in cpu_flags() else "float32"


# name -> (pagoda dtype, quantization). int8 and int4 are weight-only, LM head included.
CONFIGS = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": (_int8_activations(), "int8"),
    "int4": ("float32", "int4"),  # int4's kernel quantizes x to int8 itself; fp32 keeps the rest fast anywhere
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GiB = 1 << 30
_STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress on stdout, flushed, with seconds since the script started."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", flush=True)


def add_common_args(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: all cores this process may use)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per measurement (median reported)")
    parser.add_argument("--quick", action="store_true", help="short settings for development (not for reporting)")
    parser.add_argument("--out", default=out, help="JSON output (a PNG is written beside it where there is one)")


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for subprocesses (servers)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    wanted = ("Model name", "CPU(s)", "L2 cache", "L3 cache", "Hypervisor vendor", "Flags")
    return {k: v.strip() for k, v in fields.items() if k.strip() in wanted and k.strip() != "Flags"}


def environment(load_at_start: list[float]) -> dict:
    from pagoda.kernels import cpu_flags, cpu_kernels, simd_target

    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {
        "torch": torch.__version__, "transformers": transformers_version, "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_affinity": len(os.sched_getaffinity(0)), "lscpu": _lscpu(), "machine": platform.machine(),
        "pagoda_kernels": cpu_kernels() is not None,
        "pagoda_kernel_target": simd_target()[0], "pagoda_kernel_target_reason": simd_target()[1],
        "cpu_simd_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx"))),
        "load_average_start": load_at_start,
        "load_average_end": load_average(), "argv": sys.argv,
    }


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples),
            "samples": samples}


def write_json(path: str, data: dict) -> None:
    write_result(path, data)
    log(f"wrote {path}")


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids clear of the special ids (0-9); the same seed gives every engine the same prompts."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


# --- the machine's limits ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Gemm:
    name: str
    k: int  # input features
    n: int  # output features
    count: int  # how many per forward (layers)


def model_gemms(config) -> list[Gemm]:
    """The linear layers of one forward, as pagoda fuses them (qkv, gate_up), LM head last."""
    c, layers = config, config.num_layers
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [Gemm("qkv_proj", c.hidden_size, qkv, layers),
            Gemm("o_proj", c.num_heads * c.head_dim, c.hidden_size, layers),
            Gemm("gate_up_proj", c.hidden_size, 2 * c.intermediate_size, layers),
            Gemm("down_proj", c.intermediate_size, c.hidden_size, layers),
            Gemm("lm_head", c.hidden_size, c.vocab_size, 1)]


def linear_flops(config, num_tokens: int, num_sampled: int) -> float:
    """2*M*K*N over the layers' GEMMs for num_tokens rows, plus the LM head for the sampled rows."""
    gemms = model_gemms(config)
    layer = sum(2 * num_tokens * g.k * g.n * g.count for g in gemms[:-1])
    return layer + 2 * num_sampled * gemms[-1].k * gemms[-1].n


def attention_flops(config, query_lens: list[int], context_lens: list[int]) -> float:
    """Useful (causal) QK^T and PV FLOPs: each query attends to the keys at or before it."""
    per_pair = 4 * config.num_heads * config.head_dim * config.num_layers
    pairs = sum(q * c - q * (q - 1) / 2 for q, c in zip(query_lens, context_lens))
    return per_pair * pairs


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must stream: every linear weight (LM head included) and norm, each once."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue  # one row per token; the tied LM head is counted as the linear that reads all of it
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.data_ptr() in seen or module.__class__.__name__ == "RotaryEmbedding":
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def kv_read_bytes(config, dtype: torch.dtype, context_lens: list[int]) -> int:
    return config.kv_bytes_per_token(dtype) * sum(context_lens)


def _gemm_op(kind: str, m: int, g: Gemm):
    """A callable doing y = x @ W.T the way the engine does for more than 8 rows, and its operands."""
    if kind == "fp32":
        x, w = torch.randn(m, g.k), torch.randn(g.n, g.k)
        return lambda: F.linear(x, w)
    x, w = torch.randn(m, g.k, dtype=torch.bfloat16), torch.randn(g.n, g.k, dtype=torch.bfloat16)
    if kind == "bf16":
        return lambda: F.linear(x, w)
    if kind == "int8":  # torch's weight-only int8 GEMM (Int8Linear uses pagoda's kernel up to 64 rows instead)
        q, scale = torch.randint(-127, 128, (g.n, g.k), dtype=torch.int8), torch.rand(g.n, dtype=torch.bfloat16)
        return lambda: torch._weight_int8pack_mm(x, q, scale)
    if kind == "int8_dequant":  # the alternative: dequantize to bf16 each call, then a bf16 GEMM
        q, scale = torch.randint(-127, 128, (g.n, g.k), dtype=torch.int8), torch.rand(g.n, dtype=torch.bfloat16)
        return lambda: F.linear(x, q.to(torch.bfloat16) * scale[:, None])
    raise ValueError(kind)


def gemm_seconds(kind: str, m: int, gemm: Gemm, repeats: int, min_seconds: float = 0.05) -> list[float]:
    """Seconds per call of one GEMM (median-able samples), as `call_seconds` measures them."""
    return call_seconds(_gemm_op(kind, m, gemm), repeats, min_seconds)


def call_seconds(op, repeats: int, min_seconds: float = 0.05) -> list[float]:
    """Seconds per call of op (median-able samples), after a warm-up call; each sample loops until it
    lasts about min_seconds."""
    op()
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < min_seconds / 5 or calls < 1:
        op()
        calls += 1
    per_call = (time.perf_counter() - started) / calls
    inner = max(1, int(min_seconds / max(per_call, 1e-7)))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            op()
        samples.append((time.perf_counter() - started) / inner)
    return samples


def matmul_floor(kind: str, config, num_tokens: int, num_sampled: int, repeats: int) -> dict:
    """Time for the model's GEMMs at these row counts, each GEMM timed at its own shape: the compute
    floor of a forward. Returns per-GEMM medians, total seconds and the effective FLOP rate."""
    per_gemm, total, flops = {}, 0.0, 0.0
    for gemm in model_gemms(config):
        rows = num_sampled if gemm.name == "lm_head" else num_tokens
        if rows == 0:
            continue
        seconds = statistics.median(gemm_seconds(kind, rows, gemm, repeats))
        per_gemm[gemm.name] = {"m": rows, "k": gemm.k, "n": gemm.n, "count": gemm.count, "seconds": seconds,
                               "flop_per_s": 2 * rows * gemm.k * gemm.n / seconds}
        total += seconds * gemm.count
        flops += 2 * rows * gemm.k * gemm.n * gemm.count
    return {"kind": kind, "gemms": per_gemm, "seconds": total, "flops": flops, "flop_per_s": flops / total}


# --- the engine ------------------------------------------------------------------------------------


def make_llm(model: str, config: str, num_seqs: int, max_len: int, max_batched_tokens: int = 4096, **options):
    from pagoda import LLM

    dtype, quantization = CONFIGS[config]
    blocks = num_seqs * (max_len // 16 + 2) + 16  # explicit pool: enough for the workload, no more
    return LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=max(num_seqs, 1),
               max_num_batched_tokens=max_batched_tokens, max_model_len=max_len + 16, num_kv_blocks=blocks,
               **options)


@dataclass
class StepRecord:
    seconds: float
    num_tokens: int  # tokens computed this step
    num_decodes: int  # of which single-token decodes
    context_lens: list[int]  # per scheduled request, including this step's tokens


def run_engine(engine, prompts: list[list[int]], max_tokens: int, after_step=None) -> list[StepRecord]:
    """Adds the prompts (greedy, ignore_eos) and steps to completion, timing every step() (and calling
    after_step(), untimed, after each)."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{index}", prompt, params)
    scheduled: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        scheduled.append([(item.num_tokens, item.request.num_computed_tokens + item.num_tokens)
                          for item in output.scheduled])
        return output

    engine.scheduler.schedule = recording_schedule
    records: list[StepRecord] = []
    try:
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - started
            items = scheduled.pop()
            records.append(StepRecord(elapsed, sum(n for n, _ in items), sum(n == 1 for n, _ in items),
                                      [c for _, c in items]))
            if after_step is not None:
                after_step()
    finally:
        del engine.scheduler.schedule  # back to the class method
    return records


def fraction(limit_seconds: float, measured_seconds: float) -> float:
    return limit_seconds / measured_seconds if measured_seconds > 0 else float("nan")


def save_bar_png(path: str, title: str, labels: list[str], values: list[float], targets: list[float | None],
                 ylabel: str) -> None:
    """One bar per figure, its target as a tick mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    bars = ax.bar(range(len(labels)), values, color="#4c72b0")
    for i, (bar, target) in enumerate(zip(bars, targets)):
        ax.annotate(f"{values[i]:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
        if target is not None:
            ax.hlines(target, i - 0.4, i + 0.4, colors="#c44e52", linestyles="--")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"wrote {path}")
