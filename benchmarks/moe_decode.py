"""Mixture-of-experts decode: bench-moe against its bandwidth floor and against a dense model of the same
active parameters (bench-moe-dense), plus 32-stream throughput, measured in one run.

  batch 1   one 128-token prompt, 128 new tokens, greedy; a decode step's time is the generation's time
            less the prefill's (a one-token generation), over the new tokens less one.
            floor = the bytes the step reads / streaming-read bandwidth over a buffer of that size (sampled after
            each model's run; one median over both models' samples is the machine's figure), the bytes
            being calc's (`Deployment.weights_read_at(1)`: every weight outside the routed experts and the two
            chosen experts per layer, in the model's dtype; tests/test_moe_calc.py holds it to the engine's
            counted reads) plus the KV read at the mean context.
            Targets: MoE step floor / step time >= 0.7; MoE tok/s >= 0.8 x the dense model's.
  batch 32  32 prompts 128 -> 64, greedy, ignore_eos: tokens generated / wall time.

llama.cpp's server on the same weights, same client, is benchmarks/vs_llama_cpp.py (llama.cpp's converter
takes Mixtral: `benchmarks/llama_cpp.sh gguf models/bench-moe`).

    python scripts/make_bench_models.py --only bench-moe --only bench-moe-dense
    python benchmarks/moe_decode.py [--dtype bfloat16] [--threads N] [--repeats 3]
    python benchmarks/moe_decode.py --quick --moe-model DIR --dense-model DIR   # a tiny run, not for reporting
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from bandwidth import read_bandwidth
from common import add_common_args, environment, load_average, log, make_prompts, set_threads, summary, write_json

from pagoda import LLM, SamplingParams
from pagoda.calc.deployment import CalcInputs, derive
from pagoda.calc.presets import resolve_gpu
from pagoda.calc.shapes import shape_from_path
from pagoda.model.loader import load_model_config

REPO_ROOT = Path(__file__).resolve().parent.parent
CALC_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def step_bytes(model_dir: str, dtype: str, context_len: int, batch: int = 1) -> float:
    """Weights read by one decode step (calc's figure) plus the KV of `batch` sequences at `context_len`."""
    deployment = derive(CalcInputs(model=shape_from_path(Path(model_dir)), gpu=resolve_gpu("h100-sxm"),
                                   dtype=CALC_DTYPES[dtype], batch=batch))
    kv = load_model_config(model_dir).kv_bytes_per_token(dtype) * context_len * batch
    return deployment.weights_read_at(batch) + kv


def timed(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def measure(model_dir: str, name: str, args) -> dict:
    prompt_len, new_tokens = args.prompt_len, args.new_tokens
    llm = LLM(model_dir, dtype=args.dtype, max_num_seqs=args.streams, max_model_len=prompt_len + new_tokens + 8,
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    timed(llm, make_prompts(1, 16, vocab, seed=99), 4)  # warm-up
    step_times = []
    for repeat in range(args.repeats):
        prompt = make_prompts(1, prompt_len, vocab, seed=repeat)
        prefill_s = timed(llm, prompt, 1)
        step_times.append((timed(llm, prompt, new_tokens) - prefill_s) / (new_tokens - 1))
        log(f"  {name} batch 1 repeat {repeat + 1}/{args.repeats}: {1 / step_times[-1]:.1f} tok/s")
    step_s = statistics.median(step_times)
    read = step_bytes(model_dir, args.dtype, prompt_len + new_tokens // 2)
    bandwidth_samples = read_bandwidth(int(read), args.repeats)
    throughput = []
    for repeat in range(args.repeats):
        prompts = make_prompts(args.streams, prompt_len, vocab, seed=100 + repeat)
        throughput.append(args.streams * args.stream_tokens / timed(llm, prompts, args.stream_tokens))
        log(f"  {name} {args.streams} streams repeat {repeat + 1}/{args.repeats}: {throughput[-1]:.1f} tok/s")
    del llm
    gc.collect()
    return {"model": name, "step_bytes": read, "bandwidth_samples": bandwidth_samples, "step_s": summary(step_times),
            "tokens_per_s": 1 / step_s, "streams": args.streams, "stream_tokens_per_s": summary(throughput)}


def add_floors(rows: list[dict]) -> float:
    """One bandwidth for the machine, the median of every model's samples (their buffers differ by well under 1%,
    and the host's bandwidth swings more between samples than between the models' measurements), and each row's
    floor from it. Returns the bandwidth."""
    bandwidth = statistics.median(sample for row in rows for sample in row["bandwidth_samples"])
    for row in rows:
        row["floor_s"] = row["step_bytes"] / bandwidth
        row["fraction_of_floor"] = row["floor_s"] * row["tokens_per_s"]
    return bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, out=str(REPO_ROOT / "benchmarks/results/moe_decode.json"))
    parser.add_argument("--moe-model", default=str(REPO_ROOT / "models/bench-moe"))
    parser.add_argument("--dense-model", default=str(REPO_ROOT / "models/bench-moe-dense"))
    parser.add_argument("--dtype", choices=sorted(CALC_DTYPES), default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.new_tokens, args.streams, args.stream_tokens = 16, 8, 4, 4
    args.repeats = args.repeats or (1 if args.quick else 3)
    set_threads(args.threads)
    load_at_start = load_average()
    moe = measure(args.moe_model, "moe", args)
    dense = measure(args.dense_model, "dense", args)
    bandwidth = add_floors([moe, dense])
    ratio = moe["tokens_per_s"] / dense["tokens_per_s"]
    print(f"\n{'model':<8}{'tok/s b=1':>11}{'floor':>9}{'of floor':>10}{f'tok/s x{args.streams}':>14}")
    for row in (moe, dense):
        print(f"{row['model']:<8}{row['tokens_per_s']:>11.1f}{1 / row['floor_s']:>9.1f}"
              f"{row['fraction_of_floor']:>10.2f}{row['stream_tokens_per_s']['median']:>14.1f}")
    print(f"MoE / dense at batch 1: {ratio:.2f}x (target >= 0.8); MoE of its floor: "
          f"{moe['fraction_of_floor']:.2f} (target >= 0.7)")
    write_json(args.out, {"moe": moe, "dense": dense, "moe_over_dense": ratio, "bandwidth_bytes_per_s": bandwidth,
                          "dtype": args.dtype,
                          "quick": args.quick, "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
