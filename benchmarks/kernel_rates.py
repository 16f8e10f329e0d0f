"""How fast pagoda's decode matmul kernels stream their weights, against this machine's read bandwidth.

A batch-1 decode step reads every weight once, so its floor is weight bytes / bandwidth, and each kernel's
share of that floor is what this measures: for every linear shape of a model (qkv, o, gate_up, down, LM
head; bench-1b's by default), each kernel at 1 and 4 rows of x, with the weights coming from memory:
copies of the weight are cycled until the working set is several times the last-level cache, and the time
per call is turned into weight bytes (scales included) per second and a fraction of the streaming-read
bandwidth (`bandwidth.StreamingReader`, best reader) measured just before, in every repeat: the kinds are
interleaved, so a host whose bandwidth drifts (a neighbour's memory traffic) hits them alike.

Kernels: fp32, bf16 and int8 GEMVs (the AVX-512 full set), and the int4 matmul at group sizes 32, 64 and 128
(the full set's AVX-512 form where it is built, else the AVX2 module's). Weights are random codes in each
kernel's own layout (the rate does not depend on their values); x is fp32, bf16 for bf16 weights.

    python benchmarks/kernel_rates.py [--threads 2] [--model bench-1b] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bandwidth import StreamingReader
from common import (
    add_common_args,
    environment,
    load_average,
    log,
    model_gemms,
    set_threads,
    write_json,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
INT4_GROUPS = (32, 64, 128)
Call = Callable[[torch.Tensor, int], torch.Tensor]  # (x, copy index) -> y


def int4_group(kind: str) -> int:
    return int(kind.removeprefix("int4-g"))


def weight_bytes(kind: str, n: int, k: int) -> int:
    """One [n, k] weight's bytes in `kind`'s layout, scales included."""
    if kind in ("fp32", "bf16"):
        return n * k * (4 if kind == "fp32" else 2)
    if kind == "int8":
        return n * k + 4 * n  # fp32 scale per output channel
    return n * k // 2 + (k // int4_group(kind)) * n * 4  # bf16 (scale, offset) per group and row


def make_kernel(module, kind: str, n: int, k: int, copies: int) -> Call:
    """A call running `kind` on copy i of `copies` [n, k] weights, stored back to back."""
    if kind in ("fp32", "bf16"):
        w = torch.randn(copies * n, k, dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
        gemv = module.gemv_fp32 if kind == "fp32" else module.gemv_bf16
        return lambda x, i: gemv(x, w[i * n:(i + 1) * n])
    if kind == "int8":
        q = torch.randint(-127, 128, (copies * n, k), dtype=torch.int8)
        scale = torch.rand(n)
        return lambda x, i: module.gemv_int8(x, q[i * n:(i + 1) * n], scale)
    group = int4_group(kind)
    packed = torch.randint(0, 256, (copies * n, k // 2), dtype=torch.uint8)
    pairs = (torch.rand(copies, n // 32, k // group, 32, 2) * 0.01).bfloat16()  # block-major, as layers hold them
    return lambda x, i: module.matmul_int4(x, packed[i * n:(i + 1) * n], group, pairs[i])


def seconds_per_call(call: Call, x: torch.Tensor, copies: int) -> float:
    """One sweep over every copy (each call's weights cold), seconds per call."""
    started = time.perf_counter()
    for i in range(copies):
        call(x, i)
    return (time.perf_counter() - started) / copies


def measure_gemm(args, gemm, kinds: list[str], modules: dict[str, object], reader: StreamingReader) -> list[dict]:
    """Every kind on one shape, interleaved: each repeat reads the bandwidth, then sweeps every kind and row
    count once, so that a drifting host (a neighbour's memory traffic) hits all of them alike; each sample's
    fraction is against the bandwidth of its own repeat."""
    calls = {}
    for kind in kinds:
        if kind.startswith("int4") and gemm.k % int4_group(kind):
            continue
        copies = max(2, math.ceil(args.working_set_mb * 2**20 / weight_bytes(kind, gemm.n, gemm.k)))
        calls[kind] = (make_kernel(modules[kind], kind, gemm.n, gemm.k, copies), copies)
    inputs = {(kind, rows): torch.randn(rows, gemm.k).to(torch.bfloat16 if kind == "bf16" else torch.float32)
              for kind in calls for rows in args.rows}
    for (kind, _), x in inputs.items():  # warm up: first touch, thread pool
        seconds_per_call(calls[kind][0], x, calls[kind][1])
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {key: [] for key in inputs}
    for _ in range(args.repeats):
        bandwidth = reader.best_rate()
        for (kind, rows), x in inputs.items():
            samples[kind, rows].append((seconds_per_call(calls[kind][0], x, calls[kind][1]), bandwidth))
    results = []
    for (kind, rows), pairs in samples.items():
        weight = weight_bytes(kind, gemm.n, gemm.k)
        seconds = statistics.median(s for s, _ in pairs)
        fraction = statistics.median(weight / s / b for s, b in pairs)
        results.append({"gemm": gemm.name, "n": gemm.n, "k": gemm.k, "kind": kind, "rows": rows,
                        "weight_bytes": weight, "copies": calls[kind][1], "seconds": seconds,
                        "bytes_per_s": weight / seconds, "fraction_of_bandwidth": round(fraction, 3),
                        "bandwidth_samples": [b for _, b in pairs]})
        log(f"{gemm.name:13s} [{gemm.n}x{gemm.k}] {kind:9s} rows {rows}: {seconds * 1e3:7.3f} ms, "
            f"{weight / seconds / 1e9:5.1f} GB/s, {fraction:.2f} of the read bandwidth")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, str(REPO_ROOT / "benchmarks" / "results" / "kernel_rates.json"))
    parser.add_argument("--model", default="bench-1b", help="whose linear shapes, under models/")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kinds", nargs="+", default=None,
                        help="fp32 bf16 int8 int4-g32 int4-g64 int4-g128 (default: all this CPU runs)")
    parser.add_argument("--working-set-mb", type=int, default=256,
                        help="weight copies cycled per kernel: several times the last-level cache")
    args = parser.parse_args()
    if args.quick:
        args.working_set_mb, args.rows = 128, [1]
    args.repeats = args.repeats or 7
    set_threads(args.threads)
    load_at_start = load_average()

    from pagoda.kernels import avx2_kernels, cpu_kernels

    full = cpu_kernels()
    int4_module = full or avx2_kernels()
    available = (["fp32", "bf16", "int8"] if full is not None else []) + \
        ([f"int4-g{g}" for g in INT4_GROUPS] if int4_module is not None else [])
    kinds = args.kinds or available
    missing = sorted(set(kinds) - set(available))
    if missing:
        raise SystemExit(f"kernels {missing} are not built for this CPU (available: {available})")
    model_dir = REPO_ROOT / "models" / args.model
    if not model_dir.is_dir():
        raise SystemExit(f"models/{args.model} missing: python scripts/make_bench_models.py --only {args.model}")
    from pagoda.model.loader import load_model_config

    reader = StreamingReader(args.working_set_mb * 2**20)
    modules = {kind: int4_module if kind.startswith("int4") else full for kind in kinds}
    gemms = model_gemms(load_model_config(model_dir))
    results = [r for gemm in gemms for r in measure_gemm(args, gemm, kinds, modules, reader)]
    print_table(results)
    write_json(args.out, {"results": results, "settings": {k: v for k, v in vars(args).items() if k != "out"},
                          "environment": environment(load_at_start)})


def print_table(results: list[dict]) -> None:
    print("\nweight GB/s (median) and, in brackets, the median fraction of the read bandwidth beside it")
    rows = sorted({r["rows"] for r in results})
    kinds = list(dict.fromkeys(r["kind"] for r in results))
    print(f"{'gemm':14s}{'kind':10s}" + "".join(f"{f'rows {m}':>16s}" for m in rows))
    for gemm in dict.fromkeys(r["gemm"] for r in results):
        for kind in kinds:
            cells = {r["rows"]: r for r in results if r["gemm"] == gemm and r["kind"] == kind}
            if cells:
                print(f"{gemm:14s}{kind:10s}" + "".join(
                    f"{cells[m]['bytes_per_s'] / 1e9:9.1f} ({cells[m]['fraction_of_bandwidth']:.2f})" if m in cells
                    else f"{'':16s}" for m in rows))


if __name__ == "__main__":
    main()
