"""Prefill/decode disaggregation against colocated serving on one machine, in one run.

Three set-ups of the same model, each given two threads in all:
  split     a prefill replica and a decode replica (TcpConnector, one thread each) behind
            `pagoda route --pd-disaggregation`;
  one       one replica with two threads;
  routed    two replicas (one thread each) behind `pagoda route --policy cache_aware`.
Two workloads under Poisson arrivals (`pagoda bench --arrival poisson`, ignore_eos, seeded):
  long-prompt  --long-input-len prompt tokens, --long-output-len answer tokens (lopsided: the split's case);
  mixed        --mixed-input-len prompts and --mixed-output-len answers, both spread +-75% (uniform).
Reported per set-up and workload: TTFT p50/p99, ITL p99, goodput at --slo (requests/s meeting every bound, and
their fraction), and for the split the handoff per request (blocks, bytes, seconds, from the decode replica's
TCP counters over the router's transfer count) beside `pagoda calc --disagg`'s prediction (bytes from the
model's KV shape at the mean prompt length; seconds at --kv-link-gbps). Prints a table and writes JSON.

On 2 cores the split is expected to lose on throughput: each replica gets one thread, so the prefill replica's
compute sits idle while the decode replica waits on long answers (and the reverse), where a colocated replica
lends both threads to whichever phase has work; every handoff also copies the KV twice more through memory
(out of the producer's pool, into the consumer's). What it buys is steady ITL for the decodes, which never
share a step with a prompt. Run it on a quiet machine:

    python benchmarks/disaggregation.py --model models/bench-125m --out benchmarks/results/disaggregation.json
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

from pagoda.calc import formulas
from pagoda.calc.shapes import shape_from_path

RESULTS = Path(__file__).resolve().parent / "results" / "disaggregation.json"
BLOCK_SIZE = 16
PRODUCER = {"kv_connector": "TcpConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_buffer_size": 500_000_000}


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value, every sample of the server's /metrics."""
    values: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                values[key] = float(value)
    return values


def total(metrics: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name and label in k)


class Setup:
    """The processes of one set-up; `url` is where clients send requests."""

    def __init__(self, name: str, args: argparse.Namespace, work_dir: Path) -> None:
        self.name, self.args, self.work_dir = name, args, work_dir
        self.processes: list[subprocess.Popen] = []
        self.replicas: dict[str, str] = {}
        self.url = ""

    def serve(self, role: str, threads: int, *extra: str) -> str:
        port = free_port()
        command = [sys.executable, "-m", "pagoda", "serve", "--model", self.args.model, "--host", HOST, "--port",
                   str(port), "--threads", str(threads), "--dtype", self.args.dtype, "--block-size", str(BLOCK_SIZE),
                   "--num-kv-blocks", str(self.args.num_kv_blocks), "--max-model-len", str(self.args.max_model_len),
                   "--max-num-seqs", "32", *extra]
        env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        process, url = start_server(command, self.work_dir / f"{self.name}-{role}.log", timeout=300, env=env)
        self.processes.append(process)
        self.replicas[role] = url
        return url

    def route(self, *flags: str) -> None:
        port = free_port()
        command = [sys.executable, "-m", "pagoda", "route", "--tokenizer", self.args.model, "--host", HOST,
                   "--port", str(port), "--poll-interval", "0.5", *flags]
        process, self.url = start_server(command, self.work_dir / f"{self.name}-router.log", timeout=120)
        self.processes.append(process)

    def start(self) -> Setup:
        if self.name == "split":
            prefill = self.serve("prefill", 1, "--kv-transfer-config", json.dumps(PRODUCER))
            decode = self.serve("decode", 1, "--kv-transfer-config", json.dumps(CONSUMER))
            self.route("--pd-disaggregation", "--prefill", prefill, "--decode", decode)
        elif self.name == "one":
            self.url = self.serve("replica", 2)
        else:
            first, second = self.serve("replica-0", 1), self.serve("replica-1", 1)
            self.route("--policy", "cache_aware", "--replica", first, "--replica", second)
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_server(process)


def run_workload(setup: Setup, workload: str, args: argparse.Namespace) -> dict:
    if workload == "long-prompt":
        shape = ["--input-len", str(args.long_input_len), "--output-len", str(args.long_output_len)]
        rate = args.long_rate
    else:
        shape = ["--input-len", str(args.mixed_input_len), "--input-spread", "0.75", "--output-len",
                 str(args.mixed_output_len), "--output-dist", "uniform", "--output-spread", "0.75"]
        rate = args.mixed_rate
    for url in setup.replicas.values():
        urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=30)
    time.sleep(1.0)  # counters are published after each step and every 0.5 s when idle
    decode = setup.replicas.get("decode")
    before = scrape(decode) if decode else {}
    router_before = scrape(setup.url) if decode else {}
    out = setup.work_dir / f"bench-{setup.name}-{workload}.json"
    bench = [sys.executable, "-m", "pagoda", "bench", "--base-url", setup.url, "--api", "completions", "--tokenizer",
             args.model, "--workload", "random", *shape, "--ignore-eos", "--request-rate", str(rate), "--arrival",
             "poisson", "--num-requests", str(args.num_requests), "--warmup", "1", "--seed", str(args.seed),
             "--slo", args.slo, "--no-progress", "--no-plot", "--out", str(out)]
    subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["endpoints"][0]["levels"][0]["summary"]
    goodput = summary.get("goodput") or {}
    row = {"setup": setup.name, "workload": workload, "request_rate": rate, "num_ok": summary["num_ok"],
           "num_requests": summary["num_requests"], "ttft_p50_s": summary["ttft"]["p50"],
           "ttft_p99_s": summary["ttft"]["p99"], "itl_p99_s": summary["itl"]["p99"],
           "output_throughput": summary["output_throughput"], "goodput_requests_per_s": goodput.get("requests_per_s"),
           "goodput_fraction": goodput.get("fraction"),
           "mean_prompt_tokens": summary["input_tokens"] / max(summary["num_ok"], 1)}
    if decode:
        time.sleep(1.0)
        row["handoff"] = handoff(before, scrape(decode), router_before, scrape(setup.url), row, args)
    return row


def handoff(before: dict, after: dict, router_before: dict, router_after: dict, row: dict,
            args: argparse.Namespace) -> dict:
    """What crossed the wire per transferred request, beside calc's figure at the mean prompt length."""
    def delta(name: str, label: str, source: tuple[dict, dict] = (before, after)) -> float:
        return total(source[1], name, label) - total(source[0], name, label)

    transfers = delta("pagoda_router_pd_transfers_total", "", (router_before, router_after))
    moved = delta("vllm:kv_offload_total_bytes_total", 'transfer_type="TCP_to_GPU"')
    seconds = delta("vllm:kv_offload_total_time_total", 'transfer_type="TCP_to_GPU"')
    blocks = delta("pagoda:kv_offload_hit_blocks_total", 'medium="TCP"')
    arch = shape_from_path(Path(args.model)).architecture
    assert arch is not None
    per_token = formulas.kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, args.dtype)
    predicted = formulas.handoff_bytes(round(row["mean_prompt_tokens"]), BLOCK_SIZE, per_token)
    per_request = (lambda amount: amount / transfers if transfers else None)
    return {"transfers": transfers, "fallbacks": delta("pagoda_router_pd_fallbacks_total", "",
                                                         (router_before, router_after)),
            "blocks_per_request": per_request(blocks), "bytes_per_request": per_request(moved),
            "seconds_per_request": per_request(seconds), "calc_bytes_per_request": predicted,
            "calc_seconds_per_request": predicted / (args.kv_link_gbps * 1e9), "kv_link_gbps": args.kv_link_gbps,
            "measured_gbps": moved / seconds / 1e9 if seconds else None}


def print_rows(rows: list[dict]) -> None:
    print(f"{'set-up':<8}{'workload':<13}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'goodput':>14}")
    for r in rows:
        good = "-" if r["goodput_requests_per_s"] is None else \
            f"{r['goodput_requests_per_s']:.2f}/s {r['goodput_fraction']:.0%}"
        print(f"{r['setup']:<8}{r['workload']:<13}{r['num_ok']:>3}/{r['num_requests']:<2}{r['ttft_p50_s']:>9.3f}s"
              f"{r['ttft_p99_s']:>9.3f}s{(r['itl_p99_s'] or 0):>8.3f}s{good:>14}")
    for r in rows:
        if "handoff" in r and r["handoff"]["transfers"]:
            h = r["handoff"]
            measured_ms, calc_ms = h["seconds_per_request"] * 1e3, h["calc_seconds_per_request"] * 1e3
            print(f"handoff ({r['workload']}): {h['transfers']:.0f} transfers, {h['fallbacks']:.0f} fallbacks, "
                  f"{h['bytes_per_request']:,.0f} B/request (calc {h['calc_bytes_per_request']:,.0f} at the mean "
                  f"prompt), {measured_ms:.2f} ms/request (calc {calc_ms:.2f} ms at {h['kv_link_gbps']:g} GB/s)")


def save_plot(rows: list[dict], path: Path) -> None:
    """TTFT p50/p99 and ITL p99 per set-up, one panel per workload, log scale (the split's long-prompt TTFT is
    seconds where its ITL is tens of milliseconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    figures = (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p99_s", "ITL p99"))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        width = 0.8 / len(figures)
        for index, (key, label) in enumerate(figures):
            ax.bar([i + index * width for i in range(len(mine))], [r[key] for r in mine], width, label=label)
        ax.set_xticks([i + width for i in range(len(mine))],
                      [f"{r['setup']}\ngoodput {r['goodput_fraction']:.0%}" for r in mine])
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.set_title(workload)
        ax.legend(fontsize=8)
    fig.suptitle("prefill/decode split vs colocated, 2 threads in all")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--setups", default="split,one,routed")
    parser.add_argument("--workloads", default="long-prompt,mixed")
    parser.add_argument("--long-input-len", type=int, default=1024)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--mixed-input-len", type=int, default=256)
    parser.add_argument("--mixed-output-len", type=int, default=128)
    parser.add_argument("--mixed-rate", type=float, default=1.0, help="requests/s (Poisson)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--slo", default="ttft=2s,tpot=100ms", help="pagoda bench's goodput bounds")
    parser.add_argument("--kv-link-gbps", type=float, default=2.0,
                        help="calc's link for the predicted transfer time (loopback through Python sockets)")
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="what the JSON should say about the host (say so if it was busy)")
    args = parser.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="pagoda-disagg-bench-"))
    rows = []
    for name in args.setups.split(","):
        setup = Setup(name, args, work_dir).start()
        try:
            rows += [run_workload(setup, workload, args) for workload in args.workloads.split(",")]
        finally:
            setup.stop()
    print_rows(rows)
    document = {"benchmark": "disaggregation", "command": " ".join(sys.argv), "note": args.note,
                "config": vars(args) | {"out": str(args.out)},
                "host": {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                         "loadavg_1_5_15": os.getloadavg()},
                "results": rows}
    write_result(args.out, document, indent=1)
    save_plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and its plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
