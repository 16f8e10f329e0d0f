"""The router's policies on a multi-turn chat-like workload: 2 `pagoda serve` replicas (one thread each) behind
`pagoda route`, loaded by `pagoda bench --workload multi-turn`, in one run.

For each policy, a fresh router over the same two replicas (their prefix caches reset in between) gets the same
seeded workload: conversations of --num-turns turns, each turn resending the conversation so far plus a new
user message of --input-len tokens, --output-len output tokens (ignore_eos), --concurrency conversations in
flight. Reported per policy: the replicas' own prefix-cache hit rate (vllm:prefix_cache_hits / queries over
the run), TTFT p50/p99 and total token throughput as pagoda bench measures them, and the requests each replica
served. The figures of merit are ratios to round_robin (target: cache_aware's throughput >= 1.3x). Prints a
table and writes JSON.

    python benchmarks/router.py --model models/bench-125m
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server

RESULTS = Path(__file__).resolve().parent / "results" / "router.json"


def scrape(url: str) -> dict[str, float]:
    """The replica's counters the benchmark reads (summed over label sets)."""
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total")
    values = dict.fromkeys(wanted, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


def reset_caches(replicas: list[str]) -> None:
    for url in replicas:
        urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=30)


def settle() -> None:
    """The replicas publish their counters after each engine step and every 0.5 s when idle."""
    time.sleep(1.0)


def run_policy(policy: str, replicas: list[str], args: argparse.Namespace, work_dir: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "route", "--policy", policy, "--tokenizer", args.model,
               "--host", HOST, "--port", str(port), "--poll-interval", "0.5"]
    for url in replicas:
        command += ["--replica", url]
    router, router_url = start_server(command, work_dir / f"router-{policy}.log", timeout=120)
    try:
        reset_caches(replicas)
        settle()
        before = [scrape(url) for url in replicas]
        out = work_dir / f"bench-{policy}.json"
        bench = [sys.executable, "-m", "pagoda", "bench", "--base-url", router_url, "--api", "chat",
                 "--tokenizer", args.model, "--workload", "multi-turn", "--num-turns", str(args.num_turns),
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
                 "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                 "--warmup", "0", "--seed", str(args.seed), "--no-progress", "--no-plot", "--out", str(out)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        settle()
        after = [scrape(url) for url in replicas]
    finally:
        stop_server(router)
    summary = json.loads(out.read_text())["endpoints"][0]["levels"][0]["summary"]
    queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                  for a, b in zip(after, before))
    hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
    served = [a["vllm:request_success_total"] - b["vllm:request_success_total"] for a, b in zip(after, before)]
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "served_per_replica": served,
            "ttft_p50_s": summary["ttft"]["p50"], "ttft_p99_s": summary["ttft"]["p99"],
            "total_throughput": summary["total_throughput"], "output_throughput": summary["output_throughput"],
            "num_ok": summary["num_ok"], "num_requests": summary["num_requests"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="what the JSON should say about the host")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    work_dir = Path(tempfile.mkdtemp(prefix="pagoda-router-bench-"))
    replicas, processes = [], []
    try:
        for index in range(2):
            port = free_port()
            command = [sys.executable, "-m", "pagoda", "serve", "--model", args.model, "--host", HOST, "--port",
                       str(port), "--threads", "1", "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16",
                       "--max-model-len", "2048", "--max-num-seqs", "16"]
            process, url = start_server(command, work_dir / f"replica-{index}.log", timeout=300, env=env)
            processes.append(process)
            replicas.append(url)
        rows = [run_policy(policy, replicas, args, work_dir) for policy in args.policies.split(",")]
    finally:
        for process in processes:
            stop_server(process)
    baseline = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    print(f"{'policy':<14}{'hit rate':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'tok/s':>9}{'x rr':>7}  served")
    for row in rows:
        ratio = row["total_throughput"] / baseline["total_throughput"]
        row["throughput_vs_round_robin"] = ratio
        print(f"{row['policy']:<14}{row['hit_rate']:>9.2f}{row['ttft_p50_s']:>9.2f}s{row['ttft_p99_s']:>9.2f}s"
              f"{row['total_throughput']:>9.1f}{ratio:>7.2f}  {[int(s) for s in row['served_per_replica']]}")
    document = {"benchmark": "router", "command": " ".join(sys.argv), "note": args.note,
                "config": vars(args) | {"out": str(args.out)},
                "host": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                         "loadavg_1_5_15": os.getloadavg()},
                "replicas": 2, "threads_per_replica": 1, "results": rows}
    write_result(args.out, document, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
