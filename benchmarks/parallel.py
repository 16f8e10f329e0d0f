"""Tensor and pipeline parallelism against one process, on one machine, the same threads in all.

Each layout runs in a fresh process (a process holds one split engine): one process with all `--threads`, TP = 2
and PP = 2 with the threads split across the ranks. For each it measures batch-1 decode (tok/s of one stream,
its prefill subtracted), offline throughput at `--streams` streams (output tok/s), and per rank the bytes of its
weight and KV tensors (beside `pagoda calc`'s prediction for the layout) and its resident memory. Under TP it
times rank 0's all-reduces per decode step (waiting for the other rank included: what the split costs beyond
its arithmetic); under PP, the share of the time rank 0's stage computes, in batch-1 decode steps and over the
streams run (the rest it waits or samples: the pipeline's bubble). Prints a table and writes JSON; the figures of
merit are the ratios to one process, measured in one run.

    python benchmarks/parallel.py --model models/bench-1b --threads 2 --repeats 3
    python benchmarks/parallel.py --model models/bench-1b --layouts "TP=2,TP=2 unbound" --out ...   # binding
    python benchmarks/parallel.py --model /tmp/tiny --streams 4 --prompt-len 16 --output-len 8   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import environment, load_average, log, make_prompts, save_bar_png, write_json

# The split layouts bind each rank to CPUs of its own (cpu_threads_bind "auto", the default) where the machine has
# enough; "TP=2 unbound" leaves the ranks' threads to the OS, to measure what binding changes.
LAYOUTS = {"one process": {}, "TP=2": {"tensor_parallel_size": 2}, "PP=2": {"pipeline_parallel_size": 2},
           "TP=2 unbound": {"tensor_parallel_size": 2, "cpu_threads_bind": "nobind"}}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Stopwatch:
    """Seconds spent in a method of a class, in this process, however it is called (wrapped on the class)."""

    def __init__(self, owner: type, name: str) -> None:
        self.seconds = 0.0
        original = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def calc_prediction(args: argparse.Namespace, options: dict, kv_tokens: int) -> dict:
    """What `pagoda calc` predicts one rank holds: its weights' bytes and, for a pool of `kv_tokens` tokens, its KV
    bytes. (calc splits across tensor-parallel GPUs; a pipeline stage holds its share of the layers. The GPU preset
    does not enter the bytes.)"""
    from pagoda.calc.deployment import CalcInputs, derive
    from pagoda.calc.presets import resolve_gpu
    from pagoda.calc.shapes import shape_from_path

    ranks = options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    one_gpu = derive(CalcInputs(model=shape_from_path(Path(args.model)), gpu=resolve_gpu("h100-sxm"), dtype=dtype))
    assert one_gpu.kv_bytes_per_token is not None
    split = derive(CalcInputs(model=one_gpu.inputs.model, gpu=one_gpu.inputs.gpu, dtype=dtype,
                              num_gpus=options.get("tensor_parallel_size", 1)))
    stages = options.get("pipeline_parallel_size", 1)
    assert split.kv_bytes_per_token_per_gpu is not None
    return {"ranks": ranks, "weight_bytes_per_rank": split.weight_bytes_per_gpu / stages,
            "kv_bytes_per_rank": split.kv_bytes_per_token_per_gpu * kv_tokens / stages}


def measure(args: argparse.Namespace, options: dict) -> dict:
    """One layout, in this process: the child's side of `run_layout`."""
    import os

    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.model.llama import LlamaModel
    from pagoda.model.parallel import TensorParallel

    torch.set_num_threads(args.threads)
    # Rank 0's (this process's): the workers' are theirs.
    all_reduce = Stopwatch(TensorParallel, "all_reduce")
    stage = Stopwatch(LlamaModel, "forward_stage")
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

        def decode_step_seconds() -> tuple[float, float, float]:
            """A batch-1 decode step's seconds, and rank 0's seconds in all-reduces and in its stage within it."""
            spent = (all_reduce.seconds, stage.seconds)
            short = seconds(one, 1)
            middle = (all_reduce.seconds, stage.seconds)
            long = seconds(one, args.output_len)
            steps = args.output_len - 1
            return ((long - short) / steps,
                    ((all_reduce.seconds - middle[0]) - (middle[0] - spent[0])) / steps,
                    ((stage.seconds - middle[1]) - (middle[1] - spent[1])) / steps)

        seconds(one, 2)  # warm-up
        decode, reducing, staging = decode_step_seconds()
        streams = make_prompts(args.streams, args.prompt_len, vocab, seed=2)
        staged_before = stage.seconds
        streams_seconds = seconds(streams, args.output_len)
        throughput = args.streams * args.output_len / streams_seconds
        streams_staging = (stage.seconds - staged_before) / streams_seconds
        pids = [os.getpid(), *getattr(executor, "worker_pids", list)()]
        kv_cache = llm.engine.kv_cache
        return {
            "batch1_decode_tok_s": 1 / decode,
            "streams_output_tok_s": throughput,
            "allreduce_ms_per_decode_step": reducing * 1e3,
            "allreduce_share_of_decode_step": reducing / decode,
            "rank0_stage_share_of_decode_step": staging / decode if staging else None,
            "rank0_stage_share_of_streams": streams_staging or None,
            "native_decode_per_rank": [report.native_decode for report in executor.rank_reports()],
            "calc": calc_prediction(args, options, kv_cache.num_blocks * kv_cache.block_size),
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


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each layout's runs: each timing the median of its runs (bytes are the same in every run), and the rates'
    ratios to one process's."""
    timed = ("batch1_decode_tok_s", "streams_output_tok_s", "allreduce_ms_per_decode_step",
             "allreduce_share_of_decode_step", "rank0_stage_share_of_decode_step", "rank0_stage_share_of_streams")
    results = {}
    for label, rows in runs.items():
        medians = {key: statistics.median(row[key] for row in rows) for key in timed if rows[0][key] is not None}
        results[label] = {**rows[0], **medians, "runs": rows}
    base = results["one process"]
    for row in results.values():
        row["vs_one_process"] = {key: row[key] / base[key] for key in ("batch1_decode_tok_s", "streams_output_tok_s")}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2, help="in all: split across the ranks of a split model")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every layout, interleaved; medians reported")
    parser.add_argument("--out", default="benchmarks/results/parallel.json")
    parser.add_argument("--layouts", default="one process,TP=2,PP=2",
                        help=f"comma-separated, of: {', '.join(LAYOUTS)} (one process is always run: the base)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    layouts = ["one process", *(name for name in args.layouts.split(",") if name != "one process")]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}: choose of {', '.join(LAYOUTS)}")
    if args.child is not None:
        print(json.dumps(measure(args, LAYOUTS[args.child])))
        return
    load_at_start = load_average()
    runs: dict[str, list[dict]] = {label: [] for label in layouts}
    for repeat in range(args.repeats):  # interleaved: a slow spell of the host falls on every layout alike
        for label in layouts:
            runs[label].append(run_layout(args, label))
            log(f"{label} (run {repeat + 1} of {args.repeats}): {json.dumps(runs[label][-1])}")
    results = summarise(runs)
    base = results["one process"]
    print(f"{'layout':<12} {'batch-1 tok/s':>14} {'x':>6} {f'{args.streams} streams tok/s':>18} {'x':>6} "
          f"{'all-reduce ms/step':>19} {'stage share b1/streams':>23}  "
          "weights / KV / RSS MiB per rank (calc: weights / KV)")
    for label, row in results.items():
        per_rank = ", ".join(f"{w / 2**20:.1f}/{k / 2**20:.1f}/{r / 2**20:.0f}" for w, k, r in zip(
            row["weight_bytes_per_rank"], row["kv_bytes_per_rank"], row["rss_bytes_per_rank"]))
        calc = row["calc"]
        shares = [row[key] for key in ("rank0_stage_share_of_decode_step", "rank0_stage_share_of_streams")]
        share = "-" if None in shares else f"{shares[0]:.2f} / {shares[1]:.2f}"
        decode, streams = row["batch1_decode_tok_s"], row["streams_output_tok_s"]
        print(f"{label:<12} {decode:>14.1f} {decode / base['batch1_decode_tok_s']:>6.2f} "
              f"{streams:>18.1f} {streams / base['streams_output_tok_s']:>6.2f} "
              f"{row['allreduce_ms_per_decode_step']:>19.2f} {share:>23}  "
              f"{per_rank} (calc {calc['weight_bytes_per_rank'] / 2**20:.1f} / "
              f"{calc['kv_bytes_per_rank'] / 2**20:.1f})")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results,
                          "environment": environment(load_at_start)})
    plot(results, args, str(Path(args.out).with_suffix(".png")))


def plot(results: dict[str, dict], args: argparse.Namespace, path: str) -> None:
    """Each split layout's batch-1 and streams rates over one process's, against the 0.8x target (a pipeline's at
    streams only: it cannot shorten one stream's steps)."""
    bars = []
    for label, row in results.items():
        if label != "one process":
            bars.append((f"{label}, batch 1", row["vs_one_process"]["batch1_decode_tok_s"],
                         None if label.startswith("PP") else 0.8))
            bars.append((f"{label}, {args.streams} streams", row["vs_one_process"]["streams_output_tok_s"], 0.8))
    save_bar_png(path, f"{Path(args.model).name}, {args.threads} threads in all: x one process (medians of "
                 f"{args.repeats})", [bar[0] for bar in bars], [bar[1] for bar in bars], [bar[2] for bar in bars],
                 "x one process")


if __name__ == "__main__":
    main()
