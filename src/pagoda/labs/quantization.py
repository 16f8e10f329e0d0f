"""Lab: what do smaller weights and a smaller KV cache buy in bytes and speed, and what do they cost in accuracy?

The knobs are the weights' storage (fp32, bf16, int8, int4: `--dtype`, `--quantization`) and the KV cache's
(`--kv-cache-dtype` auto, int8, fp8). The prediction is `pagoda calc`'s: the bytes of weights a decode step
reads and the KV bytes a token holds, in each format, and from them the batch-1 floor on this machine. The
measurement: the bytes the engine holds (its description, counted from its tensors, and its pool), its
accuracy on the built-in model's held-out tasks (greedy, exact match per family), and its batch-1 decode speed.

Checked on counts: KV bytes per token are calc's exactly; weight bytes are calc's exactly for fp32 and bf16
and within 2% above them for int8 and int4 (calc counts each weight at its format's bytes, while the engine
also holds per-channel scales and keeps the norms in the model's dtype); and accuracy stays within the quality
gate's bounds of fp32 (`benchmarks/quality.py`, docs/performance.md): quantized weights' mean within 3 points,
a quantized KV cache's every family within 1 point of its own weights' cache, each bound taken as at least one
answer when a family has too few items to resolve it. Speeds are reported only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pagoda.labs.decode_steps import (
    calc_kv_bytes_per_token,
    calc_step,
    calc_weight_bytes,
    calc_weight_dtype,
    decode_run,
)
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "quantization"
QUESTION = "What do smaller weights and KV buy in bytes and speed, and what do they cost in accuracy?"
# (name, engine options, the path it is judged against): fp32 is the reference; a quantized KV cache is judged
# against the same weights with their own cache, as the quality gate does.
CONFIGS: tuple[tuple[str, dict[str, Any], str | None], ...] = (
    ("fp32", {"dtype": "float32"}, None),
    ("bf16", {"dtype": "bfloat16"}, "fp32"),
    ("int8", {"dtype": "bfloat16", "quantization": "int8"}, "fp32"),
    ("int4", {"dtype": "float32", "quantization": "int4"}, "fp32"),
    ("fp32, int8 KV", {"dtype": "float32", "kv_cache_dtype": "int8"}, "fp32"),
    ("fp32, fp8 KV", {"dtype": "float32", "kv_cache_dtype": "fp8"}, "fp32"),
)
WEIGHT_MEAN_POINTS = 3.0  # quantized weights: mean accuracy within this of fp32's (the int4 gate)
KV_FAMILY_POINTS = 1.0  # a quantized KV cache: every family within this of its weights' own cache
SCALE_OVERHEAD = 0.02  # int8 / int4: what the engine holds beyond calc's bytes a weight (scales, norms)
CONTEXT = 256  # the context calc's bytes per token and floor are given
MB = 1e6


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams
    from pagoda.calc.measure import measure_this_machine
    from pagoda.demo import encode_prompts
    from pagoda.demo.tasks import held_out_set, is_correct
    from pagoda.engine_args import is_builtin_model

    per_family, decode_tokens = (8, 16) if quick else (100, 64)
    # Accuracy needs a model that learned the held-out tasks: the built-in one. Any other (a bench model's
    # random weights) is judged on its bytes and speed, and on how often its greedy tokens match fp32's.
    tasks = is_builtin_model(model)
    items = [item for family in held_out_set(per_family).values() for item in family] if tasks else []
    machine = measure_this_machine()
    params = SamplingParams(temperature=0.0, max_tokens=48)
    rows: list[dict[str, Cell]] = []
    correct: dict[str, dict[str, int]] = {}  # config -> family -> right answers
    tokens: dict[str, list[list[int]]] = {}
    for name, options, _ in CONFIGS:
        llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False, **options)
        description = llm.engine.describe()
        kv = description.kv_cache
        prompts = encode_prompts(llm.get_tokenizer(), items) if tasks else _random_prompts(llm, per_family)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[name] = [list(output.outputs[0].token_ids) for output in outputs]
        correct[name] = {}
        for item, output in zip(items, outputs):
            correct[name][item.task] = correct[name].get(item.task, 0) + is_correct(item, output.outputs[0].text)
        decode_run(llm, 1, 16, 4, seed=99)  # warm-up
        step_s = decode_run(llm, 1, 64, decode_tokens).median_step_s
        del llm
        weight_dtype = calc_weight_dtype(description.dtype, options.get("quantization"))
        point = calc_step(model, machine, weight_dtype, kv.dtype, CONTEXT, 1)
        calc_weights = calc_weight_bytes(model, weight_dtype)
        rows.append({
            "config": name, "weights": weight_dtype, "kv": kv.dtype,
            "weight_mb_calc": calc_weights / MB, "weight_mb_engine": description.weight_bytes_read_per_step / MB,
            "weight_ratio": description.weight_bytes_read_per_step / calc_weights,
            "kv_bytes_calc": calc_kv_bytes_per_token(model, kv.dtype),
            "kv_bytes_pool": kv.num_bytes / (kv.num_blocks * kv.block_size),
            "mb_per_token_calc": point.bytes_read / MB,
            "accuracy": 100 * sum(correct[name].values()) / len(items) if tasks else None,
            "same_as_fp32": sum(a == b for a, b in zip(tokens[name], tokens["fp32"])) / len(tokens[name]),
            "calc_tokens_per_s": 1 / max(point.memory_s, point.compute_s), "tokens_per_s": 1 / step_s,
        })
    fp32 = rows[0]["accuracy"]
    for row in rows:
        accuracy = row["accuracy"]
        row["points_vs_fp32"] = accuracy - fp32 if isinstance(accuracy, float) and isinstance(fp32, float) else None
    checks = [_bytes_hold(row, options) and (not tasks or _accuracy_holds(correct, name, base, per_family))
              for row, (name, options, base) in zip(rows, CONFIGS)]
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("config", "config"), ("weight_mb_calc", "weights MB: calc"), ("weight_mb_engine", "weights MB: real"),
                 ("kv_bytes_calc", "KV B/token: calc"), ("kv_bytes_pool", "KV B/token: real"),
                 ("mb_per_token_calc", f"MB/token at {CONTEXT}: calc"), ("accuracy", "accuracy %"),
                 ("points_vs_fp32", "vs fp32 (points)"), ("same_as_fp32", "same tokens as fp32"),
                 ("calc_tokens_per_s", "batch-1 tok/s: calc floor"), ("tokens_per_s", "batch-1 tok/s: real")],
        rows=rows,
        lesson=("Bytes are the formula's: a format's bytes a weight (int4: 5 bits, its group scales included) and "
                "a KV format's bytes a token, which calc and the engine's pool count alike. "
                + ("Accuracy moves far less than the bytes do: the held-out answers stay within the quality gate's "
                   "bounds of fp32 while the weights shrink up to 6x. " if tasks else
                   "(This model has no held-out tasks, so accuracy is not judged; see the built-in model's run.) ")
                + "Speed follows the bytes only as far as a step is its reads."),
        lesson_holds=all(checks),
        settings={"model": model, "accuracy_on": "held-out tasks" if tasks else f"none ({per_family} random prompts)",
                  "items_per_family": per_family, "families": sorted(correct["fp32"]),
                  "correct": correct, "context_for_calc": CONTEXT, "decode_tokens": decode_tokens,
                  "weight_mean_points": WEIGHT_MEAN_POINTS, "kv_family_points": KV_FAMILY_POINTS,
                  "checks": dict(zip((name for name, _, _ in CONFIGS), checks)),
                  "bandwidth_bytes_per_s": machine.bandwidth, "machine": machine.source, "quick": quick},
    )


def _random_prompts(llm: Any, count: int) -> list[list[int]]:
    import random

    rng, vocab = random.Random(0), len(llm.get_tokenizer())
    return [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(count)]


def _bytes_hold(row: dict[str, Cell], options: dict[str, Any]) -> bool:
    ratio = row["weight_ratio"]
    assert isinstance(ratio, float)
    weights_hold = ratio == 1.0 if "quantization" not in options else 1.0 <= ratio <= 1.0 + SCALE_OVERHEAD
    return weights_hold and row["kv_bytes_calc"] == row["kv_bytes_pool"]


def _accuracy_holds(correct: dict[str, dict[str, int]], name: str, base: str | None, per_family: int) -> bool:
    """The gate's bound, in answers: at least one, since a family of a few items cannot resolve a point."""
    if base is None:
        return True
    mine, theirs = correct[name], correct[base]
    if name.endswith("KV"):
        allowed = max(1, math.floor(KV_FAMILY_POINTS / 100 * per_family))
        return all(abs(mine[family] - theirs[family]) <= allowed for family in theirs)
    allowed = max(1, math.floor(WEIGHT_MEAN_POINTS / 100 * per_family * len(theirs)))
    return sum(theirs.values()) - sum(mine.values()) <= allowed


def plot(result: LabResult, axes: Axes) -> None:
    mb = result.column("mb_per_token_calc")
    if result.rows[0]["accuracy"] is not None:
        accuracy, label = result.column("accuracy"), "held-out accuracy (%)"
    else:  # no held-out tasks: plot agreement with fp32's greedy tokens instead
        accuracy, label = [100 * share for share in result.column("same_as_fp32")], "greedy answers same as fp32 (%)"
    axes.scatter(mb, accuracy, s=[30 * t / max(result.column("tokens_per_s")) + 10 for t in
                                  result.column("tokens_per_s")], alpha=0.6)
    for x, y, row in zip(mb, accuracy, result.rows):
        axes.annotate(str(row["config"]), (x, y), textcoords="offset points", xytext=(5, 3), fontsize=8)
    axes.set_xscale("log")
    axes.set_xlabel(f"MB read per token at batch 1, {CONTEXT}-token context (calc)")
    axes.set_ylabel(f"{label}, marker size: batch-1 tok/s")
