"""pagoda's fp32 and bf16 GEMV kernels against torch's GEMM, by rows of x: where decode with many streams stands.

A decode step of M sequences multiplies M rows by every weight. The native decode stack runs its linears as
pagoda's GEMV up to 64 rows, so at each row count this measures, on a model's linear shapes (qkv, o, gate_up,
down; bench-125m's by default), the GEMV of the selected SIMD target against `torch.nn.functional.linear` on
the same weights: GFLOP/s, the two interleaved in every repeat, medians. Under `PAGODA_SIMD_TARGET=avx2` torch's
libraries are held to AVX2 as well (`pagoda.kernels.cap_torch_isa`), so that a forced run stands in for an AVX2
host. bf16 weights on a CPU without bf16 arithmetic are the case where torch emulates bf16 (pagoda's own
fallback then runs fp32 tiles: `model/tiled_matmul.py`).

    PAGODA_SIMD_TARGET=avx2 python benchmarks/gemv_rows.py [--rows 4 8 16 32 64] [--threads 2]
"""

from __future__ import annotations

from pagoda.kernels import cap_torch_isa

cap_torch_isa()  # before torch is imported: its libraries read the caps once

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import add_common_args, environment, load_average, log, model_gemms, set_threads, write_json  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sweep_seconds(call, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    started = time.perf_counter()
    for w in weights:
        call(inputs[w.shape[1]], w)
    return time.perf_counter() - started


def measure(kernels, kind: str, rows: int, gemms, copies: int, repeats: int) -> dict:
    dtype = DTYPES[kind]
    weights = [torch.randn(g.n, g.k, dtype=dtype) for _ in range(copies) for g in gemms]
    inputs = {g.k: torch.randn(rows, g.k, dtype=dtype) for g in gemms}
    gemv = kernels.gemv_fp32 if kind == "fp32" else kernels.gemv_bf16
    calls = {"pagoda": gemv, "torch": F.linear}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm up: first touch, thread pool
        sweep_seconds(call, weights, inputs)
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(sweep_seconds(call, weights, inputs))
    flops = 2 * rows * copies * sum(g.n * g.k for g in gemms)
    rates = {name: flops / statistics.median(seconds) / 1e9 for name, seconds in samples.items()}
    result = {"kind": kind, "rows": rows, "pagoda_gflops": round(rates["pagoda"], 1),
              "torch_gflops": round(rates["torch"], 1), "ratio": round(rates["pagoda"] / rates["torch"], 2)}
    log(f"{kind} rows {rows:3d}: pagoda {rates['pagoda']:6.1f}, torch {rates['torch']:6.1f} GFLOP/s "
        f"({result['ratio']:.2f}x)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, str(REPO_ROOT / "benchmarks" / "results" / "gemv-rows.json"))
    parser.add_argument("--model", default="bench-125m", help="whose linear shapes, under models/")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--copies", type=int, default=8, help="copies of each weight cycled (not all in cache)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.copies = [8, 32], 2
    args.repeats = args.repeats or 7
    set_threads(args.threads)
    load_at_start = load_average()
    from pagoda.kernels import cpu_kernels
    from pagoda.model.loader import load_model_config

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no native kernels for this CPU: nothing to compare")
    model_dir = REPO_ROOT / "models" / args.model
    if not model_dir.is_dir():
        raise SystemExit(f"models/{args.model} missing: python scripts/make_bench_models.py --only {args.model}")
    gemms = [g for g in model_gemms(load_model_config(model_dir)) if g.name != "lm_head"]
    results = [measure(kernels, kind, rows, gemms, args.copies, args.repeats)
               for rows in args.rows for kind in DTYPES]
    write_json(args.out, {"target": kernels.target, "results": results,
                          "settings": {k: v for k, v in vars(args).items() if k != "out"},
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
