"""pagoda against llama.cpp's server on the same weights, same client (`pagoda bench --compare`), same threads.

Each pair is a pagoda configuration and the GGUF type it is measured against (fp32:f32, bf16:bf16,
int8:q8_0, int4:q4_k_m). Both servers run at once (an idle one costs nothing), and every round benchmarks
both, the order alternating between rounds so that a drifting host hits both alike. Workloads:

  batch1   one request at a time, 128-token prompts, 128 tokens out: TTFT and time per output token
  streams  32 concurrent cold streams, 128 -> 64: ITL p99, output tokens/s, TTFT p50

Needs `benchmarks/llama_cpp.sh build` and `benchmarks/llama_cpp.sh gguf <model>` first (GGUFs under
$LLAMA_CPP_DIR, default /tmp/llama-cpp).

    python benchmarks/vs_llama_cpp.py batch1 --model models/bench-1b --pairs fp32:f32,int8:q8_0,int4:q4_k_m
    python benchmarks/vs_llama_cpp.py streams --model models/bench-125m --pairs fp32:f32,bf16:bf16,int8:q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import CONFIGS, environment, load_average, log, save_bar_png, write_json
from server_process import free_port, start_server, stop_server

REPO_ROOT = Path(__file__).resolve().parent.parent
LLAMA_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/llama-cpp"))
WORKLOADS = {
    "batch1": {"bench": ["--concurrency", "1", "--input-len", "128", "--output-len", "128"], "slots": 1},
    "streams": {"bench": ["--concurrency", "32", "--input-len", "128", "--output-len", "64"], "slots": 32},
}


def servers(model: Path, config: str, gguf: Path, slots: int, threads: int, logs: Path, llama_build: Path,
            llama_args: list[str]) -> list:
    """(name, process, url) of pagoda and llama.cpp serving the pair, both healthy."""
    context = 4096
    dtype, quantization = CONFIGS[config]
    weights = ["--dtype", dtype] + ([] if quantization is None else ["--quantization", quantization])
    pagoda = [str(REPO_ROOT / ".venv/bin/pagoda"), "serve", "--model", str(model), *weights,
              "--threads", str(threads), "--max-num-seqs", str(slots), "--max-model-len", str(context),
              "--port", str(free_port()), "--uvicorn-log-level", "warning"]
    llama = [str(llama_build / "bin/llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
             "-np", str(slots), "-c", str(context * slots), "--cont-batching", "--host", "127.0.0.1",
             "--port", str(free_port()), *llama_args]
    started = []
    for name, command in (("pagoda", pagoda), ("llama.cpp", llama)):
        process, url = start_server(command, logs / f"{name}.log", timeout=600)
        started.append((name, process, url))
    return started


def bench(endpoints: list[tuple[str, str]], model: Path, workload: str, requests: int, seed: int, out: Path,
          warmup: int = 2) -> dict:
    """One round, after `warmup` unmeasured requests; its own prompts (seed), so that neither server finds them
    in its prompt cache."""
    compare = [f"{name}={url}" for name, url in endpoints]
    command = [str(REPO_ROOT / ".venv/bin/pagoda"), "bench", "--compare", *compare, "--tokenizer", str(model),
               *WORKLOADS[workload]["bench"], "--ignore-eos", "--num-requests", str(requests), "--warmup", str(warmup),
               "--seed", str(seed),
               "--out", str(out), "--no-plot"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def figures(endpoint: dict) -> dict:
    summary = endpoint["levels"][0]["summary"]
    return {"ttft_p50_s": summary["ttft"]["p50"], "tpot_p50_s": summary["tpot"]["p50"],
            "itl_p99_s": summary["itl"]["p99"], "output_tokens_per_s": summary["output_throughput"],
            "errors": summary["num_errors"]}


def run_pair(args, pair: str, logs: Path) -> dict:
    config, gguf_type = pair.split(":")
    gguf = LLAMA_DIR / f"{args.model.name}-{gguf_type}.gguf"
    log(f"{pair}: starting pagoda {config} and llama.cpp {gguf.name}")
    started = servers(args.model, config, gguf, WORKLOADS[args.workload]["slots"], args.threads, logs,
                      args.llama_build, args.llama_args.split())
    rounds: dict[str, list[dict]] = {"pagoda": [], "llama.cpp": []}
    try:
        for index in range(args.rounds):
            order = started if index % 2 == 0 else started[::-1]
            result = bench([(name, url) for name, _, url in order], args.model, args.workload, args.requests,
                           1000 * (index + 1), logs / f"round{index}.json")
            for endpoint in result["endpoints"]:
                rounds[endpoint["name"]].append(figures(endpoint))
            log(f"{pair} round {index + 1}: " + "; ".join(
                f"{name} TTFT {r[-1]['ttft_p50_s']:.3f}s TPOT {r[-1]['tpot_p50_s'] * 1e3:.1f}ms "
                f"ITL p99 {r[-1]['itl_p99_s'] * 1e3:.0f}ms {r[-1]['output_tokens_per_s']:.1f} tok/s"
                for name, r in rounds.items()))
    finally:
        for _, process, _ in started:
            stop_server(process)
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    mine, theirs = medians["pagoda"], medians["llama.cpp"]
    return {"pair": pair, "pagoda": config, "llama.cpp": gguf_type, "rounds": rounds, "median": medians,
            "ratios": {"decode_speed": theirs["tpot_p50_s"] / mine["tpot_p50_s"],
                       "ttft": mine["ttft_p50_s"] / theirs["ttft_p50_s"],
                       "itl_p99": mine["itl_p99_s"] / theirs["itl_p99_s"],
                       "throughput": mine["output_tokens_per_s"] / theirs["output_tokens_per_s"]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--pairs", default="fp32:f32,bf16:bf16,int8:q8_0,int4:q4_k_m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=None, help="per round (default: 4 batch1, 64 streams)")
    parser.add_argument("--threads", type=int, default=2)
    # The native build's AMX path stops llama-server with an illegal instruction at load of a quantized GGUF on an
    # Intel Xeon VM that lists AMX: "--no-repack" runs it there with its plain kernels; `llama_cpp.sh
    # build-no-amx` and --llama-build run its repacked (fastest) kernels.
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. --no-repack")
    parser.add_argument("--llama-build", type=Path, default=LLAMA_DIR / "build",
                        help="llama.cpp's build directory (llama_cpp.sh build-no-amx: $LLAMA_CPP_DIR/build-no-amx; "
                             "build-avx2: $LLAMA_CPP_DIR/build-avx2)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.requests = args.requests or (4 if args.workload == "batch1" else 64)
    out = args.out or REPO_ROOT / f"benchmarks/results/vs-llama-cpp-{args.workload}-{args.model.name}.json"
    load_at_start = load_average()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.pairs.split(","):
            logs = Path(tmp) / pair.replace(":", "-")
            logs.mkdir()
            results.append(run_pair(args, pair, logs))
    print(f"\n{'pair':16} {'decode speed':>13} {'TTFT':>7} {'ITL p99':>8} {'throughput':>11}   (pagoda / llama.cpp)")
    for r in results:
        ratios = r["ratios"]
        print(f"{r['pair']:16} {ratios['decode_speed']:12.2f}x {ratios['ttft']:6.2f}x {ratios['itl_p99']:7.2f}x "
              f"{ratios['throughput']:10.2f}x")
    write_json(out, {"workload": args.workload, "model": str(args.model), "settings": vars(args) | {"out": str(out)},
                     "results": results, "environment": environment(load_at_start)})
    key = "decode_speed" if args.workload == "batch1" else "throughput"
    save_bar_png(str(out.with_suffix(".png")), f"pagoda / llama.cpp ({args.model.name}, {args.workload})",
                 [r["pair"] for r in results], [r["ratios"][key] for r in results], [None] * len(results),
                 f"{key.replace('_', ' ')} ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
