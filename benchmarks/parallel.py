"""Tensor and pipeline parallelism against one process, on one machine, the same threads in all.

Each layout runs in a fresh process (a process holds one split engine): one process with all `--threads`, TP = 2
and PP = 2 with the threads split across the ranks. For each it measures batch-1 decode (tok/s of one stream,
its prefill subtracted), offline throughput at `--streams` streams (output tok/s), and per rank the bytes of its
weight and KV tensors and its resident memory. Prints a table and writes JSON; the figures of merit are the
ratios to one process, measured in one run.

    python benchmarks/parallel.py --model models/bench-1b --threads 2
    python benchmarks/parallel.py --model /tmp/tiny --streams 4 --prompt-len 16 --output-len 8   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import environment, load_average, log, make_prompts, write_json

LAYOUTS = {"one process": {}, "TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2}}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def measure(args: argparse.Namespace, options: dict) -> dict:
    """One layout, in this process: the child's side of `run_layout`."""
    import os

    import torch

    from pagoda import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    with LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.streams, 1), max_model_len=args.max_model_len,
             **options) as llm:
        vocab = llm.engine.model_config.vocab_size
        executor = llm.engine.executor
        one = make_prompts(1, args.prompt_len, vocab, seed=1)

        def seconds(prompts: list[list[int]], max_tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - started

        seconds(one, 2)  # warm-up
        decode = (seconds(one, args.output_len) - seconds(one, 1)) / (args.output_len - 1)
        streams = make_prompts(args.streams, args.prompt_len, vocab, seed=2)
        throughput = args.streams * args.output_len / seconds(streams, args.output_len)
        pids = [os.getpid(), *getattr(executor, "worker_pids", list)()]
        return {
            "batch1_decode_tok_s": 1 / decode,
            "streams_output_tok_s": throughput,
            "weight_bytes_per_rank": executor.weight_bytes_per_rank(),
            "kv_bytes_per_rank": executor.kv_bytes_per_rank(),
            "rss_bytes_per_rank": [rss_bytes(pid) for pid in pids],
        }


def run_layout(args: argparse.Namespace, label: str) -> dict:
    command = [sys.executable, __file__, "--child", label, *sys.argv[1:]]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{result.stderr[-4000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="in all: split across the ranks of a split model")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/parallel.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, LAYOUTS[args.child])))
        return
    load_at_start = load_average()
    results = {}
    for label in LAYOUTS:
        results[label] = run_layout(args, label)
        log(f"{label}: {json.dumps(results[label])}")
    base = results["one process"]
    print(f"{'layout':<12} {'batch-1 tok/s':>14} {'x':>6} {f'{args.streams} streams tok/s':>18} {'x':>6}  "
          "weights / KV / RSS MiB per rank")
    for label, row in results.items():
        per_rank = ", ".join(f"{w / 2**20:.1f}/{k / 2**20:.1f}/{r / 2**20:.0f}" for w, k, r in zip(
            row["weight_bytes_per_rank"], row["kv_bytes_per_rank"], row["rss_bytes_per_rank"]))
        print(f"{label:<12} {row['batch1_decode_tok_s']:>14.1f} "
              f"{row['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:>6.2f} "
              f"{row['streams_output_tok_s']:>18.1f} {row['streams_output_tok_s'] / base['streams_output_tok_s']:>6.2f}"
              f"  {per_rank}")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results,
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
