#!/usr/bin/env python
"""Resident memory of `pagoda serve` on the built-in model, idle: a few seconds after /health turns 200.

Each source tree is served in turn (PYTHONPATH=<tree>/src, this interpreter), so the same environment
compares two versions of pagoda, e.g. the last commit (exported with `git archive`) against the working tree:

    git archive HEAD | tar -x -C /tmp/pagoda-before
    python benchmarks/idle_rss.py --tree before=/tmp/pagoda-before --tree after=.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import environment, load_average, log, write_json
from server_process import free_port, start_server, stop_server

STARTUP_TIMEOUT_S = 300


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def idle_rss(tree: Path, settle_s: float, log_dir: Path) -> int:
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "serve", "--port", str(port)]
    env = {"PYTHONPATH": str(tree.resolve() / "src")}
    process, _url = start_server(command, log_dir / f"serve-{port}.log", STARTUP_TIMEOUT_S, env=env)
    try:
        time.sleep(settle_s)
        return rss_bytes(process.pid)
    finally:
        stop_server(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH",
                        help="a pagoda source tree to serve from (repeat: one measurement series each)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds idle after /health before reading RSS")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--out", default="benchmarks/results/idle_rss.json")
    args = parser.parse_args()
    load_at_start = load_average()
    results = {}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        samples = []
        for repeat in range(args.repeats):
            samples.append(idle_rss(Path(path), args.settle, Path(args.log_dir)))
            log(f"{label} #{repeat + 1}: {samples[-1] / 2**20:.0f} MiB")
        results[label] = {"tree": path, "rss_bytes": samples, "median_mib": round(statistics.median(samples) / 2**20)}
    print(f"\n{'tree':<10} {'idle RSS (median MiB)':>22}")
    for label, result in results.items():
        print(f"{label:<10} {result['median_mib']:>22}")
    write_json(args.out, {"benchmark": "idle_rss", "settle_s": args.settle, "results": results,
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
