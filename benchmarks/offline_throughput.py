"""Offline throughput: pagoda's LLM.generate vs transformers.generate, same weights, same run.

Default workload: 32 prompts x 128 random token ids in, 64 tokens out (ignore_eos), greedy.
transformers runs the whole batch statically (all prompts have the same length: no padding needed).
Prints a table and writes JSON; the figure of merit is the ratio, measured in one run.

    python benchmarks/offline_throughput.py --model models/bench-125m [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch
from provenance import write_result


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


def run_pagoda(llm, prompts, output_len: int, lora_request=None) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_transformers(model, prompts, output_len: int) -> float:
    input_ids = torch.tensor(prompts)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=output_len,
            min_new_tokens=output_len, do_sample=False, pad_token_id=0,
        )
    elapsed = time.perf_counter() - started
    assert out.shape[1] == input_ids.shape[1] + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/bench-125m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from pagoda import LLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    print(f"loading {args.model} ({args.dtype}), torch threads = {torch.get_num_threads()}", flush=True)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts, max_num_batched_tokens=4096,
              num_kv_blocks=args.num_prompts * (args.prompt_len + args.output_len) // 16 + 64)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    prompts = make_prompts(args.num_prompts, args.prompt_len, hf.config.vocab_size, seed=0)
    run_pagoda(llm, prompts[:2], 4)  # warm-up both (first-call allocations, oneDNN primitive caches)
    run_transformers(hf, prompts[:2], 4)

    times: dict[str, list[float]] = {"pagoda": [], "transformers": []}
    for repeat in range(args.repeats):
        times["pagoda"].append(run_pagoda(llm, prompts, args.output_len))
        times["transformers"].append(run_transformers(hf, prompts, args.output_len))
        print(f"repeat {repeat + 1}/{args.repeats}: pagoda {times['pagoda'][-1]:.2f} s, "
              f"transformers {times['transformers'][-1]:.2f} s", flush=True)

    output_tokens = args.num_prompts * args.output_len
    rows = {name: output_tokens / statistics.median(ts) for name, ts in times.items()}
    ratio = rows["pagoda"] / rows["transformers"]
    print(f"\n{'engine':<14}{'output tok/s (median)':>24}")
    for name, rate in rows.items():
        print(f"{name:<14}{rate:>24.1f}")
    print(f"{'ratio':<14}{ratio:>24.2f}x  (pagoda / transformers.generate, static batch {args.num_prompts})")
    result = {
        "workload": vars(args),
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "machine": platform.machine(), "processor": platform.processor()},
        "seconds": times,
        "output_tokens_per_s_median": rows,
        "ratio_pagoda_over_transformers": ratio,
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
