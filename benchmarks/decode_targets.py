"""Decode tokens/s on each path this CPU runs: the torch path (`use_kernels=False`) and every kernel target
(`PAGODA_SIMD_TARGET`), per weight config, at 1 and 32 concurrent sequences.

A config's model is loaded once per path; each rate is B x (out - 1) tokens over the time of the engine's steps
after the one that prefills every prompt (128 tokens each): decode alone; the median of --repeats.

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


def decode_rate(llm, batch: int, prompt_len: int, out: int, repeats: int, seed: int, clock,
                lora_request=None, vocab_size: int = 32000) -> float:
    """Decode tokens/s of `batch` sequences (on `lora_request`'s adapter, if given): the engine's steps after
    the one that prefills every prompt."""
    from pagoda import SamplingParams

    engine, rng, rates = llm.engine, random.Random(seed), []
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    for repeat in range(repeats):
        for index in range(batch):  # fresh prompts: no prefix-cache hits
            engine.add_request(f"decode-{seed}-{repeat}-{index}",
                               [rng.randrange(10, vocab_size) for _ in range(prompt_len)], params,
                               lora_request=lora_request)
        engine.step()  # every prompt, and each sequence's first token (max_num_batched_tokens holds them all)
        started, steps = clock(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = clock() - started
        assert steps == out - 1, f"{steps} decode steps for {out} tokens: the prompts did not prefill in one step"
        rates.append(batch * steps / elapsed)
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
                      max_num_seqs=32, max_model_len=args.prompt_len + args.out_len + 16,
                      max_num_batched_tokens=32 * args.prompt_len)
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
