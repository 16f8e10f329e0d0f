"""Decode tokens/s on each path this CPU runs: the torch path (`use_kernels=False`) and every kernel target
(`PAGODA_SIMD_TARGET`), per weight config, at 1 and 32 concurrent sequences.

A config's model is loaded once per path; each rate is (B x (out - 1) tokens) / (time to generate `out` tokens
- time to generate 1), so prefill (128-token prompts) is left out; the median of --repeats.

    python benchmarks/decode_targets.py --model models/bench-125m --configs fp32,bf16,int8 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

from common import CONFIGS, add_common_args, environment, load_average, log, set_threads, write_json

from pagoda.kernels import TARGET_ENV, available_targets


def generate_seconds(llm, prompts: list[list[int]], tokens: int, clock) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = clock()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = clock() - started
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return elapsed


def decode_rate(llm, batch: int, prompt_len: int, out: int, repeats: int, seed: int, clock) -> float:
    rng = random.Random(seed)
    rates = []
    for _ in range(repeats):
        prompts = [[rng.randrange(10, 32000) for _ in range(prompt_len)] for _ in range(batch)]
        first = generate_seconds(llm, prompts, 1, clock)
        prompts = [[rng.randrange(10, 32000) for _ in range(prompt_len)] for _ in range(batch)]  # no prefix hits
        whole = generate_seconds(llm, prompts, out, clock)
        rates.append(batch * (out - 1) / (whole - first))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--configs", default="fp32,bf16,int8")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out-len", type=int, default=64)
    # cpu: tokens per second of the process's CPU time, for a shared host (with --threads 1, one core's rate;
    # the engine's threads count too); wall: what a user sees, on a quiet host.
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    add_common_args(parser, "benchmarks/results/decode-targets.json")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    set_threads(args.threads)
    from pagoda import LLM

    load_at_start, results = load_average(), []
    for config in args.configs.split(","):
        dtype, quantization = CONFIGS[config]
        for path in ["torch", *available_targets()]:
            if path != "torch":
                os.environ[TARGET_ENV] = path
            llm = LLM(args.model, dtype=dtype, quantization=quantization, use_kernels=path != "torch",
                      max_num_seqs=32, max_model_len=args.prompt_len + args.out_len + 16)
            backend = llm.engine.model.backend
            native_stack = getattr(backend, "decode_runner", None) is not None
            for batch in (int(b) for b in args.batches.split(",")):
                clock = time.perf_counter if args.clock == "wall" else time.process_time
                rate = decode_rate(llm, batch, args.prompt_len, args.out_len, args.repeats, batch, clock)
                results.append({"config": config, "dtype": dtype, "quantization": quantization, "path": path,
                                "native_decode_stack": native_stack, "batch": batch, "decode_tokens_per_s": rate})
                log(f"{config} {path:6} batch {batch:2}: {rate:7.1f} decode tokens/s"
                    + (" (native decode stack)" if native_stack else ""))
            del llm
            gc.collect()
    write_json(args.out, {"settings": vars(args), "results": results, "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
