"""Speculative verification at decode speed: a step whose requests each bring 1 + k query tokens against a
decode step with the same number of rows (one token from each of B(1 + k) requests).

Both are the model's forward and LM head over decode-only attention metadata, as the runner builds it: a
speculating request's positions attend as one-token decodes that see the keys up to themselves, so the
native decode stack takes both steps whole. Every request has `--context` tokens cached before the step.
The two layouts alternate `--repeats` times per row (medians reported), so a drifting host hits both.

    python benchmarks/verify_step.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import add_common_args, environment, load_average, log, set_threads, write_json

from pagoda import LLM
from pagoda.demo import DEMO_MODEL_DIR
from pagoda.model.attention import build_metadata

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = {"pagoda-demo": DEMO_MODEL_DIR, "bench-125m": REPO_ROOT / "models" / "bench-125m",
          "bench-1b": REPO_ROOT / "models" / "bench-1b"}
SHAPES = [(1, 1), (1, 2), (1, 4), (4, 3), (8, 3)]  # (requests B, drafts k)


def step_seconds(llm: LLM, seq_lens: list[int], tables: list[list[int]]) -> float:
    """One forward and LM head over one-token queries with these sequence lengths and block tables."""
    runner = llm.engine.runner
    meta = build_metadata([1] * len(seq_lens), seq_lens, tables, runner.block_size, runner.windows)
    input_ids = torch.randint(llm.engine.model_config.vocab_size, (len(seq_lens),))
    start = time.perf_counter()
    with torch.inference_mode():
        hidden = runner.model(input_ids, meta.positions, runner.kv_caches, meta)
        runner.model.compute_logits(hidden)
    return time.perf_counter() - start


def layouts(num_requests: int, k: int, context: int, block_size: int) -> tuple[list, list]:
    """(seq_lens, block tables) of the verification step and of the decode step with as many rows."""
    per_request = -(-(context + k + 1) // block_size)
    table = [list(range(r * per_request, (r + 1) * per_request)) for r in range(num_requests * (1 + k))]
    verify = ([context + 1 + i for _ in range(num_requests) for i in range(1 + k)],
              [table[r] for r in range(num_requests) for _ in range(1 + k)])
    decode = ([context + 1] * (num_requests * (1 + k)), table)
    return verify, decode


def measure(name: str, model: Path, args) -> list[dict]:
    block_size = 16
    per_request = -(-(args.context + max(k for _, k in SHAPES) + 1) // block_size)
    num_blocks = max(b * (1 + k) for b, k in SHAPES) * per_request
    llm = LLM(str(model), num_kv_blocks=num_blocks, block_size=block_size)
    for kv in llm.engine.runner.kv_caches:  # attention reads these: zeros, not whatever was there
        kv.k.zero_()
        kv.v.zero_()
    rows = []
    for num_requests, k in SHAPES:
        verify, decode = layouts(num_requests, k, args.context, block_size)
        for _ in range(2):  # warm-up
            step_seconds(llm, *verify), step_seconds(llm, *decode)
        times: dict[str, list[float]] = {"verify": [], "decode": []}
        for _ in range(args.repeats):
            times["verify"].append(step_seconds(llm, *verify))
            times["decode"].append(step_seconds(llm, *decode))
        verify_ms, decode_ms = (statistics.median(times[key]) * 1e3 for key in ("verify", "decode"))
        rows.append({"model": name, "dtype": str(llm.engine.runner.model.dtype).removeprefix("torch."),
                     "requests": num_requests, "k": k, "rows": num_requests * (1 + k),
                     "verify_ms": round(verify_ms, 3), "decode_ms": round(decode_ms, 3),
                     "ratio": round(verify_ms / decode_ms, 3)})
        log(f"{name}: {num_requests} x (1 + {k}) rows: verify {verify_ms:.2f} ms, decode {decode_ms:.2f} ms, "
            f"ratio {verify_ms / decode_ms:.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, str(REPO_ROOT / "benchmarks" / "results" / "verify-step.json"))
    parser.add_argument("--context", type=int, default=256, help="tokens cached per request before the step")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    args.repeats = args.repeats or (5 if args.quick else 21)
    set_threads(args.threads)
    load_at_start = load_average()
    rows = []
    for name in args.models:
        if not MODELS[name].is_dir():
            log(f"{MODELS[name]} missing (python scripts/make_bench_models.py --only {name}): skipped")
            continue
        rows += measure(name, MODELS[name], args)
    print(f"{'model':>12} {'B':>3} {'k':>2} {'rows':>4} {'verify ms':>10} {'decode ms':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:>12} {r['requests']:>3} {r['k']:>2} {r['rows']:>4} {r['verify_ms']:>10.2f} "
              f"{r['decode_ms']:>10.2f} {r['ratio']:>6.3f}")
    write_json(args.out, {"rows": rows, "settings": {k: v for k, v in vars(args).items() if k != "out"},
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    sys.exit(main())
