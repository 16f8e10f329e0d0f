"""The step-time target's trade-off: time to first token against inter-token latency, in one run.

For each `--max-step-ms` setting (0 = no cap: every prompt's whole chunk in one step), a fresh `pagoda
serve` takes the same closed-loop workload from `pagoda bench`: C streams whose prompts and outputs vary
in length, so that new prompts keep arriving while other streams decode (their prefill is what stalls
the others). Same seed, cold prefix cache, for every setting. Reports TTFT, ITL and TPOT percentiles and
output throughput per setting, and each setting's ratio to the uncapped run.

    python benchmarks/stall_tradeoff.py [--settings 0,200,500] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import environment, load_average, log, write_json
from server_process import HOST, free_port, start_server, stop_server

METRICS = (("ttft", "p50"), ("ttft", "p99"), ("itl", "p50"), ("itl", "p99"), ("itl", "max"), ("tpot", "p50"),
           ("tpot", "p99"))


def serve_command(args, max_step_ms: float, port: int) -> list[str]:
    return [sys.executable, "-m", "pagoda", "serve", "--model", args.model, "--host", HOST, "--port", str(port),
            "--dtype", args.dtype, "--threads", str(args.threads), "--max-num-seqs", str(args.concurrency),
            "--max-step-ms", str(max_step_ms), "--uvicorn-log-level", "warning"]


def bench_command(args, url: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "pagoda.bench", "--base-url", url, "--tokenizer", args.model,
            "--concurrency", str(args.concurrency), "--input-len", str(args.input_len), "--input-dist", "uniform",
            "--input-spread", "0.5", "--output-len", str(args.output_len), "--output-dist", "uniform",
            "--output-spread", "0.5", "--ignore-eos", "--num-requests", str(args.num_requests), "--warmup", "1",
            "--seed", str(args.seed), "--reset-prefix-cache", "--out", str(out), "--no-plot", "--no-progress"]


def run_setting(args, max_step_ms: float, work: Path) -> dict:
    port = free_port()
    command = serve_command(args, max_step_ms, port)
    log(f"max_step_ms {max_step_ms:g}: starting {' '.join(command[2:])}")
    process, url = start_server(command, work / f"serve-{max_step_ms:g}.log", timeout=600)
    try:
        out = work / f"bench-{max_step_ms:g}.json"
        subprocess.run(bench_command(args, url, out), check=True)
    finally:
        stop_server(process)
    level = json.loads(out.read_text())["endpoints"][0]["levels"][0]
    summary = level["summary"]
    row = {"max_step_ms": max_step_ms, "output_throughput": summary["output_throughput"],
           "num_ok": summary["num_ok"], "client_behind": level["client"]["behind"]}
    row |= {f"{metric}_{stat}": summary[metric][stat] for metric, stat in METRICS}
    log("  " + ", ".join(f"{key} {value:.3g}" for key, value in row.items() if isinstance(value, float)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/bench-125m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--settings", default="0,200,500", help="--max-step-ms values (0: no cap)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=512, help="mean prompt tokens (uniform +-50%%)")
    parser.add_argument("--output-len", type=int, default=32, help="mean output tokens (uniform +-50%%)")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run (not for reporting)")
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--out", default="benchmarks/results/stall_tradeoff.json")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.input_len, args.output_len, args.num_requests = 4, 128, 8, 6
    load_start = load_average()
    work = Path(tempfile.mkdtemp(prefix="pagoda-stall-"))
    rows = [run_setting(args, float(setting), work) for setting in args.settings.split(",")]
    baseline = next((row for row in rows if row["max_step_ms"] == 0), None)
    if baseline is not None:
        for row in rows:
            row["vs_uncapped"] = {key: row[key] / baseline[key] for key in row
                                  if key not in ("max_step_ms", "num_ok", "client_behind") and baseline[key]}
    print(f"\n{'max_step_ms':>11}{'out tok/s':>10}" + "".join(f"{m + ' ' + s:>11}" for m, s in METRICS) + "  (s)")
    for row in rows:
        print(f"{row['max_step_ms']:>11g}{row['output_throughput']:>10.2f}"
              + "".join(f"{row[f'{m}_{s}']:>11.3f}" for m, s in METRICS))
    write_json(args.out, {"config": vars(args), "environment": environment(load_start), "rows": rows,
                          "logs": str(work)})


if __name__ == "__main__":
    main()
