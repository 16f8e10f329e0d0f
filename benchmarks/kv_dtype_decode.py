"""Decode with an int8 KV cache against a bf16 one (--kv-cache-dtype), on bench-125m in bf16.

Each step is a decode of `--batch` sequences with `--context` tokens cached each (the model's forward and LM
head over one-token queries, as the runner builds them: the native decode stack runs it whole), from a cache
filled with random K/V in each format. The two formats alternate, in alternating order, `--repeats` times, each
turn `--steps` steps; tokens/s is the median turn's. Beside the measured ratio, calc's prediction: the bytes a
decode step reads (every weight once, every sequence's KV) with bf16 KV over those with int8 KV, its scales
included (pagoda.calc.formulas, as `pagoda calc --kv-dtype int8` counts them). A short context is measured the
same way: there the step is the weights' read, and the two formats should be within noise.

    python benchmarks/kv_dtype_decode.py [--model models/bench-125m] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import add_common_args, environment, load_average, log, set_threads, weight_bytes, write_json

from pagoda import LLM
from pagoda.calc import formulas
from pagoda.model.attention import build_metadata

REPO_ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("bfloat16", "int8")  # --kv-cache-dtype auto (the model's bf16), and int8
BLOCK_SIZE = 16


def engine(model: Path, cache_dtype: str, batch: int, context: int, steps: int) -> LLM:
    """A bf16 engine whose KV pool holds `batch` sequences of `context + steps` tokens, filled with random K/V."""
    per_sequence = -(-(context + steps) // BLOCK_SIZE)
    llm = LLM(str(model), dtype="bfloat16", kv_cache_dtype="auto" if cache_dtype == "bfloat16" else cache_dtype,
              num_kv_blocks=batch * per_sequence, block_size=BLOCK_SIZE, max_model_len=per_sequence * BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    for kv in llm.engine.runner.kv_caches:
        slots = torch.arange(kv.k.shape[0])
        shape = (slots.numel(), *kv.k.shape[1:])
        kv.write(slots, torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
    return llm


def turn_seconds(llm: LLM, batch: int, context: int, steps: int) -> float:
    """`steps` decode steps of the batch, from `context` cached tokens on; seconds taken."""
    runner = llm.engine.runner
    per_sequence = -(-(context + steps) // BLOCK_SIZE)
    tables = [list(range(b * per_sequence, (b + 1) * per_sequence)) for b in range(batch)]
    windows = set(llm.engine.model_config.sliding_windows) or {None}
    metas = [build_metadata([1] * batch, [context + 1 + step] * batch, tables, BLOCK_SIZE, windows)
             for step in range(steps)]
    input_ids = torch.randint(llm.engine.model_config.vocab_size, (batch,))
    start = time.perf_counter()
    with torch.inference_mode():
        for meta in metas:
            runner.model.compute_logits(runner.model(input_ids, meta.positions, runner.kv_caches, meta))
    return time.perf_counter() - start


def predicted_ratio(llm: LLM, batch: int, context: int) -> dict:
    """calc's bytes per decode step (weights once, every sequence's KV) with bf16 KV, over those with int8 KV."""
    config = llm.engine.model_config
    weights = weight_bytes(llm.engine.model)
    kv = {name: formulas.kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, name)
          for name in ("bf16", "int8")}
    step = {name: weights + batch * context * per_token for name, per_token in kv.items()}
    return {"weight_bytes": weights, "kv_bytes_per_token": kv, "bytes_per_step": step,
            "ratio": round(step["bf16"] / step["int8"], 3)}


def measure(model: Path, batch: int, context: int, args) -> dict:
    llms = {name: engine(model, name, batch, context, args.steps) for name in FORMATS}
    assert llms["int8"].engine.describe().kv_cache.dtype == "int8"
    assert llms["int8"].engine.model.backend.decode_runner is not None, "the native decode stack must run"
    for llm in llms.values():  # warm-up
        turn_seconds(llm, batch, context, args.steps)
    seconds: dict[str, list[float]] = {name: [] for name in FORMATS}
    for repeat in range(args.repeats):
        for name in FORMATS if repeat % 2 == 0 else FORMATS[::-1]:
            seconds[name].append(turn_seconds(llms[name], batch, context, args.steps))
    tokens_per_s = {name: round(batch * args.steps / statistics.median(seconds[name]), 1) for name in FORMATS}
    prediction = predicted_ratio(llms["int8"], batch, context)
    ratio = round(tokens_per_s["int8"] / tokens_per_s["bfloat16"], 3)
    row = {"batch": batch, "context": context, "steps_per_turn": args.steps, "repeats": args.repeats,
           "tokens_per_s": tokens_per_s, "turn_seconds": {k: [round(s, 4) for s in v] for k, v in seconds.items()},
           "int8_over_bf16": ratio, "calc_predicted_ratio": prediction["ratio"],
           "of_predicted": round(ratio / prediction["ratio"], 3), "calc": prediction}
    log(f"batch {batch} x context {context}: bf16 KV {tokens_per_s['bfloat16']} tok/s, int8 KV "
        f"{tokens_per_s['int8']} tok/s: {ratio}x (calc predicts {prediction['ratio']}x)")
    for llm in llms.values():
        llm.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, str(REPO_ROOT / "benchmarks" / "results" / "kv-dtype-decode.json"))
    parser.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "bench-125m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=2000, help="tokens cached per sequence")
    parser.add_argument("--short-context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed turn")
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.quick else 9)
    if args.quick:
        args.context, args.steps = 500, 4
    if not args.model.is_dir():
        sys.exit(f"{args.model} missing: python scripts/make_bench_models.py --only bench-125m")
    set_threads(args.threads)
    load_at_start = load_average()
    rows = [measure(args.model, args.batch, context, args) for context in (args.context, args.short_context)]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    write_json(args.out, {"rows": rows, "settings": settings, "environment": environment(load_at_start)})


if __name__ == "__main__":
    sys.exit(main())
