"""LoRA adapters' cost: 32 streams with 4 adapters mixed in one batch against the base alone, and batch-1 decode
on an adapter against the base, measured in one run.

Four seeded PEFT adapters (`init_lora_weights=False`, so they change the output) of rank --rank on every
projection (q, k, v, o, gate, up, down) are made for --model and saved as users save theirs. Two engines:
the base model as it is served without `--enable-lora`, and one with `--enable-lora --max-loras 4`. Rounds
alternate their order so that a drifting host hits both alike; medians are reported.

  streams  32 prompts 128 -> 64 at once, greedy, ignore_eos: output tokens / wall time. Base: the plain engine.
           Mixed: the LoRA engine, the 32 prompts spread over the 4 adapters (8 each). Target: mixed >= 0.75x base.
  batch 1  one 128-token prompt, 64 new tokens: decode tokens/s (the steps after the prefill step). Base: the
           plain engine; adapter: the LoRA engine on one adapter. Target: adapter >= 0.8x base.
Also reported: the base model through the LoRA engine (no adapter in the batch), which prices having the
feature on.

    python benchmarks/lora_throughput.py --model models/bench-125m --threads 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

from common import add_common_args, environment, load_average, log, make_prompts, save_bar_png, set_threads
from decode_targets import decode_rate
from offline_throughput import run_pagoda
from provenance import write_result

ADAPTERS = 4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model: str, rank: int, out_dir: Path) -> list[Path]:
    import peft
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    paths = []
    for index in range(ADAPTERS):
        torch.manual_seed(index)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS),
                                 init_lora_weights=False, lora_dropout=0.0)
        adapted = peft.get_peft_model(base, config)
        path = out_dir / f"adapter-{index}"
        adapted.save_pretrained(str(path))
        base = adapted.unload()  # the base without this adapter's modules, for the next one
        paths.append(path)
    return paths


def throughput(llm, prompts, out_len: int, lora_requests) -> float:
    return len(prompts) * out_len / run_pagoda(llm, prompts, out_len, lora_requests)


def batch1_rate(llm, out_len: int, prompt_len: int, vocab: int, seed: int, lora_request) -> float:
    return decode_rate(llm, 1, prompt_len, out_len, 1, seed, time.perf_counter, lora_request, vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out-len", type=int, default=64)
    add_common_args(parser, "benchmarks/results/lora.json")
    args = parser.parse_args()
    set_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 5)
    streams, out_len = (8, 16) if args.quick else (args.streams, args.out_len)
    load_at_start = load_average()

    from pagoda import LLM, LoRARequest

    with tempfile.TemporaryDirectory() as scratch:
        log(f"making {ADAPTERS} rank-{args.rank} adapters on every projection")
        requests = [LoRARequest(f"adapter-{i}", i + 1, str(path))
                    for i, path in enumerate(make_adapters(args.model, args.rank, Path(scratch)))]
        gc.collect()
        options = dict(dtype=args.dtype, max_num_seqs=streams, max_model_len=args.prompt_len + out_len + 16,
                       num_kv_blocks=streams * ((args.prompt_len + out_len) // 16 + 2) + 16,
                       enable_prefix_caching=False)
        plain = LLM(args.model, **options)
        lora = LLM(args.model, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=args.rank, **options)
        mixed = [requests[i % ADAPTERS] for i in range(streams)]
        vocab = plain.engine.model_config.vocab_size
        runs: dict[str, list[float]] = {name: [] for name in
                                        ("streams base", "streams mixed", "streams base, lora on",
                                         "batch-1 base", "batch-1 adapter", "batch-1 base, lora on")}
        # Warm both engines (kernels, adapter loading) outside the measurement.
        throughput(plain, make_prompts(streams, args.prompt_len, vocab, seed=99), 4, None)
        throughput(lora, make_prompts(streams, args.prompt_len, vocab, seed=98), 4, mixed)
        for repeat in range(repeats):
            prompts = make_prompts(streams, args.prompt_len, vocab, seed=repeat)  # fresh each round
            args_1 = (out_len, args.prompt_len, vocab)
            for engine in ("plain", "lora") if repeat % 2 == 0 else ("lora", "plain"):
                if engine == "plain":
                    runs["streams base"].append(throughput(plain, prompts, out_len, None))
                    runs["batch-1 base"].append(batch1_rate(plain, *args_1, 3 * repeat, None))
                else:
                    runs["streams mixed"].append(throughput(lora, prompts, out_len, mixed))
                    runs["streams base, lora on"].append(throughput(lora, prompts, out_len, None))
                    runs["batch-1 adapter"].append(batch1_rate(lora, *args_1, 3 * repeat + 1, requests[0]))
                    runs["batch-1 base, lora on"].append(batch1_rate(lora, *args_1, 3 * repeat + 2, None))
            log(f"round {repeat + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratios = {
        "streams mixed / base": medians["streams mixed"] / medians["streams base"],
        "streams base lora on / base": medians["streams base, lora on"] / medians["streams base"],
        "batch-1 adapter / base": medians["batch-1 adapter"] / medians["batch-1 base"],
        "batch-1 base lora on / base": medians["batch-1 base, lora on"] / medians["batch-1 base"],
    }
    targets = {"streams mixed / base": 0.75, "batch-1 adapter / base": 0.8}
    for name, value in medians.items():
        print(f"{name:>24}: {value:8.1f} tok/s")
    for name, value in ratios.items():
        target = targets.get(name)
        print(f"{name:>30}: {value:.3f}" + (f" (target {target})" if target else ""))
    result = {
        "benchmark": "lora_throughput",
        "config": {"model": args.model, "dtype": args.dtype, "rank": args.rank, "adapters": ADAPTERS,
                   "projections": list(PROJECTIONS), "streams": streams, "prompt_len": args.prompt_len,
                   "out_len": out_len, "threads": args.threads, "repeats": repeats, "quick": args.quick},
        "tokens_per_s": {name: {"median": medians[name], "runs": runs[name]} for name in runs},
        "ratios": ratios, "targets": targets,
        "environment": environment(load_at_start),
    }
    write_result(args.out, result)
    save_bar_png(str(Path(args.out).with_suffix(".png")), f"LoRA cost, {Path(args.model).name} rank {args.rank}",
                 list(ratios), list(ratios.values()), [targets.get(name) for name in ratios], "x the base alone")


if __name__ == "__main__":
    main()
