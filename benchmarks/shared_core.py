"""Batch-1 decode with a busy neighbour on one core, against the idle machine: pagoda and llama.cpp side by side.

A laptop or a shared VM rarely gives a server all its cores: a browser, a build or another tenant holds one.
With two threads on two cores and a neighbour spinning on one of them, a step whose threads meet at a barrier
waits for the thread that shares its core, so a runtime that splits every matmul evenly across threads can lose
more than the neighbour's share. This measures each server's decode speed with the neighbour (one process
spinning in a tight loop, not pinned: the kernel places it) over its speed on the idle machine, rounds
alternating idle/busy and the servers' order, medians reported. Each round starts with unmeasured requests
(`--settle-requests`), so that both runtimes are measured settled after the neighbour comes or goes: pagoda's
step thread count follows the free cores within seconds (engine/thread_tuner.py).

Both servers run at once with the same threads, weights and client as benchmarks/vs_llama_cpp.py (needs
`benchmarks/llama_cpp.sh build` and `gguf`). Target: pagoda's busy/idle ratio >= 0.4 and >= llama.cpp's.

    python benchmarks/shared_core.py --model models/bench-125m --pairs fp32:f32,bf16:bf16,int8:q8_0
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import load_average, log, save_bar_png
from provenance import write_result
from server_process import stop_server
from vs_llama_cpp import LLAMA_DIR, bench, figures, servers

NEIGHBOUR = [sys.executable, "-c", "while True: pass"]


def run_pair(args: argparse.Namespace, pair: str, logs: Path) -> dict:
    config, gguf_type = pair.split(":")
    gguf = LLAMA_DIR / f"{args.model.name}-{gguf_type}.gguf"
    started = servers(args.model, config, gguf, 1, args.threads, logs, args.llama_build, [])
    rounds: dict[str, dict[str, list[float]]] = {name: {"idle": [], "busy": []} for name, _, _ in started}
    try:
        for index in range(2 * args.rounds):
            state = "idle" if index % 2 == 0 else "busy"
            neighbour = subprocess.Popen(NEIGHBOUR) if state == "busy" else None
            try:
                order = started if (index // 2) % 2 == 0 else started[::-1]
                result = bench([(name, url) for name, _, url in order], args.model, "batch1", args.requests,
                               1000 * (index + 1), logs / f"round{index}.json", warmup=args.settle_requests)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            for endpoint in result["endpoints"]:
                rounds[endpoint["name"]][state].append(figures(endpoint)["tpot_p50_s"])
            log(f"{pair} {state}: " + "; ".join(f"{name} TPOT {r[state][-1] * 1e3:.1f} ms"
                                                for name, r in rounds.items()))
    finally:
        for _, process, _ in started:
            stop_server(process)
    medians = {name: {state: statistics.median(values) for state, values in r.items()} for name, r in rounds.items()}
    # Speed is 1 / TPOT, so busy speed over idle speed is idle TPOT over busy TPOT.
    ratios = {name: m["idle"] / m["busy"] for name, m in medians.items()}
    return {"pair": pair, "tpot_s": rounds, "median_tpot_s": medians, "busy_over_idle": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--pairs", default="fp32:f32,bf16:bf16,int8:q8_0")
    parser.add_argument("--rounds", type=int, default=3, help="idle/busy round pairs")
    parser.add_argument("--requests", type=int, default=4, help="per round")
    parser.add_argument("--settle-requests", type=int, default=10,
                        help="unmeasured requests to each server at the start of a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-build", type=Path, default=LLAMA_DIR / "build")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shared-core.json")
    args = parser.parse_args()
    load_at_start = load_average()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.pairs.split(","):
            logs = Path(tmp) / pair.replace(":", "-")
            logs.mkdir()
            results.append(run_pair(args, pair, logs))
    print(f"\n{'pair':16} {'pagoda busy/idle':>17} {'llama.cpp busy/idle':>20}")
    for r in results:
        print(f"{r['pair']:16} {r['busy_over_idle']['pagoda']:16.2f}x {r['busy_over_idle']['llama.cpp']:19.2f}x")
    settings = {key: str(value) for key, value in vars(args).items()}
    write_result(args.out, {"model": str(args.model), "settings": settings, "load_at_start": load_at_start,
                            "results": results})
    labels = [f"{r['pair']} {name}" for r in results for name in ("pagoda", "llama.cpp")]
    values = [r["busy_over_idle"][name] for r in results for name in ("pagoda", "llama.cpp")]
    save_bar_png(str(args.out.with_suffix(".png")), f"decode speed, one core busy / idle ({args.model.name})",
                 labels, values, [0.4] * len(values), "busy / idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
