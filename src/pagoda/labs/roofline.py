"""Lab: how close does decode come to the machine's bandwidth floor, and how far does batching move it?

The knob is the decode batch. The prediction is `pagoda calc`'s for this machine (`--gpu this-machine`: a
streaming copy for the bandwidth, a numpy matmul for the compute roof, both measured here): a decode step reads
every weight once and each sequence's KV, so at batch B its bytes are W + B x KV per sequence, its flops
B x flops per token, and its floor the slower of bytes / bandwidth and flops / peak. At batch 1 the floor is
the bandwidth's; as B grows the bytes per token fall as 1/B until the step reaches the compute roof.

Counted, and checked: the weight bytes calc predicts a step reads are those the engine streams (its
description's, counted from the tensors it holds), its KV bytes per token the pool's, and every decode step
computes exactly B tokens (the engine's tokens-per-step counter), so bytes per token are calc's over B.
The step times, and so the measured share of the floor, are reported only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.labs.decode_steps import calc_kv_bytes_per_token, calc_step, calc_weight_bytes, decode_run
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "roofline"
QUESTION = "How close is decode to the bandwidth floor, and how far does batching move it to the compute roof?"
PROMPT_TOKENS = 64
MB = 1e6


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM
    from pagoda.calc.measure import measure_this_machine

    batches, output_tokens = ((1, 4, 16), 16) if quick else ((1, 2, 4, 8, 16, 32, 64, 128), 64)
    llm = LLM(model, max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * PROMPT_TOKENS),
              enable_prefix_caching=False)
    description = llm.engine.describe()
    kv = description.kv_cache
    decode_run(llm, 2, PROMPT_TOKENS, 4, seed=99)  # warm-up: an engine's first steps are slow
    machine = measure_this_machine()  # after the model's load, on the same threads' machine as the steps
    # A decode step's context runs from the prompt to the prompt plus the answer: calc is given its mean.
    context = PROMPT_TOKENS + output_tokens // 2
    rows: list[dict[str, Cell]] = []
    for batch in batches:
        measured = decode_run(llm, batch, PROMPT_TOKENS, output_tokens, seed=batch)
        point = calc_step(model, machine, description.dtype, kv.dtype, context, batch)
        step_s = measured.median_step_s
        rows.append({
            "batch": batch, "decode_steps": measured.steps, "tokens_per_step": measured.tokens_per_step,
            "bytes_per_step_mb": point.bytes_read / MB, "bytes_per_token_mb": point.bytes_read / batch / MB,
            "intensity": point.intensity, "bound": point.bound,
            "floor_ms": 1e3 * max(point.memory_s, point.compute_s), "step_ms": 1e3 * step_s,
            "calc_tokens_per_s": batch / max(point.memory_s, point.compute_s), "tokens_per_s": batch / step_s,
            "share_of_floor": max(point.memory_s, point.compute_s) / step_s,
            "achieved_flop_per_s": point.flops / step_s,
        })
    shape_kv = calc_kv_bytes_per_token(model, kv.dtype)
    pool_kv = kv.num_bytes / (kv.num_blocks * kv.block_size)
    calc_weights = calc_weight_bytes(model, description.dtype)
    del llm
    holds = (calc_weights == description.weight_bytes_read_per_step and shape_kv == pool_kv
             and all(row["decode_steps"] == output_tokens - 1 and row["tokens_per_step"] == row["batch"]
                     for row in rows))
    ridge = formulas.ridge_point(machine.peak_flops, machine.bandwidth)
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("batch", "batch"), ("tokens_per_step", "tokens/step"), ("bytes_per_step_mb", "MB/step: calc"),
                 ("bytes_per_token_mb", "MB/token: calc"), ("intensity", "flop/byte"), ("bound", "bound: calc"),
                 ("floor_ms", "floor ms: calc"), ("step_ms", "step ms: real"),
                 ("calc_tokens_per_s", "tok/s: calc"), ("tokens_per_s", "tok/s: real"),
                 ("share_of_floor", "floor / real")],
        rows=rows,
        lesson=("A decode step reads every weight once whatever the batch, so its bytes barely grow with B while "
                "its tokens grow as B: bytes per token fall as 1/B, the flops per byte rise, and the floor moves "
                "from the bandwidth towards the compute roof. What calc counts is what the engine reads; the gap "
                "between floor and step time is the work around the matmuls that neither roof counts."),
        lesson_holds=holds,
        settings={"model": model, "dtype": description.dtype, "kv_dtype": kv.dtype, "prompt_tokens": PROMPT_TOKENS,
                  "output_tokens": output_tokens, "context_for_calc": context, "threads": description.num_threads,
                  "weight_bytes_calc": calc_weights,
                  "weight_bytes_engine": description.weight_bytes_read_per_step,
                  "kv_bytes_per_token_calc": shape_kv, "kv_bytes_per_token_pool": pool_kv,
                  "bandwidth_bytes_per_s": machine.bandwidth, "peak_flop_per_s": machine.peak_flops,
                  "ridge_flop_per_byte": ridge, "machine": machine.source, "quick": quick},
    )


def plot(result: LabResult, axes: Axes) -> None:
    settings = result.settings
    bandwidth, peak = settings["bandwidth_bytes_per_s"], settings["peak_flop_per_s"]
    intensities = result.column("intensity")
    low, high = min(intensities) / 2, max(max(intensities), settings["ridge_flop_per_byte"]) * 2
    xs = [low * (high / low) ** (i / 63) for i in range(64)]
    axes.loglog(xs, [min(peak, x * bandwidth) / 1e9 for x in xs], "k-", label="calc: min(peak, intensity x bandwidth)")
    axes.loglog(intensities, [v / 1e9 for v in result.column("achieved_flop_per_s")], "o--", label="engine")
    for x, y, batch in zip(intensities, result.column("achieved_flop_per_s"), result.column("batch")):
        axes.annotate(f"B={batch:g}", (x, y / 1e9), textcoords="offset points", xytext=(4, -10), fontsize=8)
    axes.set_xlabel("arithmetic intensity (flop / byte read)")
    axes.set_ylabel("GFLOP/s")
    axes.legend(fontsize=8)
