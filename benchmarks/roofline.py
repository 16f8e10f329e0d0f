"""Roofline: pagoda's speed as a fraction of this machine's own limits, measured in the same run.

Limits: streaming-read bandwidth (a >= 1 GiB buffer, a buffer the size of the step's own bytes, and for
decode a read right after every step, up to 1 GiB: the host's bandwidth drifts within seconds)
and matmul rate at the model's own GEMM shapes (fp32 / bf16 F.linear, int8 weight-only
torch._weight_int8pack_mm or dequantize+bf16, whichever is faster). Workloads, greedy, ignore_eos:

  decode   batch-1, 128-token prompt, 128 new tokens: floor = (weight + KV bytes per step) / bandwidth
  prefill  one 1,024-token prompt: floor = the model's GEMMs at M=1024, each timed at its shape
  offline  32 prompts 128 -> 64 on bench-125m: prefill floor + each batch-32 decode step's
           max(bytes / bandwidth, GEMMs at M=32)

fraction = floor / measured (1.0 = at the limit). Configs: fp32, bf16, int8 (weight-only W8A16, LM head
included), int4 (W4A16 group 32 with fp32 activations, LM head included). Targets: bench-1b decode fp32 >= 0.85,
bf16/int8 >= 0.6, int4 >= 0.8; prefill >= 0.7 (int4: of the fp32 GEMMs' rate).

    python benchmarks/roofline.py [--threads 2] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bandwidth import StreamingReader, read_bandwidth
from common import (
    CONFIGS,
    TORCH_DTYPES,
    GiB,
    add_common_args,
    attention_flops,
    environment,
    fraction,
    kv_read_bytes,
    linear_flops,
    load_average,
    log,
    make_llm,
    make_prompts,
    matmul_floor,
    run_engine,
    save_bar_png,
    set_threads,
    summary,
    weight_bytes,
    write_json,
)

TARGETS = {("decode", "bench-1b", "fp32"): 0.85, ("decode", "bench-1b", "bf16"): 0.6,
           ("decode", "bench-1b", "int8"): 0.6, ("decode", "bench-1b", "int4"): 0.8, ("prefill", None, None): 0.7}
# The GEMMs a config's floor is timed with, the fastest counting: int8 either of torch's two ways; int4 the dense
# GEMM in its activation dtype (fp32), the rate its prefill should keep.
FLOOR_KINDS = {"int8": ["int8", "int8_dequant"], "int4": ["fp32"]}


def target_for(kind: str, model: str, config: str) -> float | None:
    return TARGETS.get((kind, model, config), TARGETS.get((kind, None, None)))


def bandwidth(num_bytes: int, args, repeats: int | None = None) -> dict:
    size = int(min(num_bytes, args.max_buffer_gib * GiB))
    samples = read_bandwidth(size, repeats or args.repeats)
    return {"buffer_bytes": size, **summary(samples)}


def decode_workload(model_dir: str, name: str, config: str, args) -> dict:
    prompt_len, new_tokens = args.prompt_len, args.decode_tokens
    llm = make_llm(model_dir, config, 1, prompt_len + new_tokens, enable_prefix_caching=False)
    engine, model_config = llm.engine, llm.engine.model_config
    dtype = TORCH_DTYPES[CONFIGS[config][0]]
    run_engine(engine, make_prompts(1, 16, model_config.vocab_size, seed=99), 4)  # warm-up
    step_bytes = weight_bytes(engine.model)
    # A shared host's bandwidth drifts within seconds, so every decode step is paired with a read right
    # after it (one pass of each reader over min(step bytes, --step-read-gib), the fastest): a step's
    # fraction is its bytes over that read, and a repeat's is the median of its steps'.
    reader = StreamingReader(int(min(step_bytes, args.step_read_gib * GiB)))
    runs, fractions, bw_samples = [], [], []
    for repeat in range(args.repeats):
        reads: list[float] = []
        records = run_engine(engine, make_prompts(1, prompt_len, model_config.vocab_size, seed=repeat), new_tokens,
                             after_step=lambda reads=reads: reads.append(reader.best_rate()))
        steps, step_reads = records[1:], reads[1:]  # records[0] is the prefill
        kv_bytes = [kv_read_bytes(model_config, dtype, r.context_lens) for r in steps]
        floors = [(step_bytes + kv) / bw for kv, bw in zip(kv_bytes, step_reads)]
        step_fractions = [floor / r.seconds for floor, r in zip(floors, steps)]
        fractions.append(statistics.median(step_fractions))
        bw_samples += step_reads
        runs.append({"prefill_s": records[0].seconds, "decode_step_s": [r.seconds for r in steps],
                     "kv_bytes_mean": statistics.mean(kv_bytes),
                     "step_read_bytes_per_s": step_reads, "step_floor_s": floors, "step_fraction": step_fractions,
                     "fraction": fractions[-1]})
        log(f"  {name} {config} decode repeat {repeat + 1}/{args.repeats}: "
            f"{1 / statistics.median(runs[-1]['decode_step_s']):.1f} tok/s, reads next to the steps "
            f"{min(step_reads) / 1e9:.1f}-{max(step_reads) / 1e9:.1f} GB/s (median "
            f"{statistics.median(step_reads) / 1e9:.1f}), fraction {fractions[-1]:.2f}")
    del llm, engine
    gc.collect()
    step_s = statistics.median(statistics.median(r["decode_step_s"]) for r in runs)
    bw = statistics.median(bw_samples)
    return {"kind": "decode", "model": name, "config": config, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "weight_bytes": step_bytes, "kv_bytes_mean": statistics.mean(r["kv_bytes_mean"] for r in runs),
            "bandwidth": {"buffer_bytes": min(step_bytes, args.step_read_gib * GiB), **summary(bw_samples)},
            "runs": runs, "step_s": step_s, "tokens_per_s": 1 / step_s,
            "floor_s": statistics.median(f for r in runs for f in r["step_floor_s"]),
            "limit": f"{bw / 1e9:.1f} GB/s", "fraction": statistics.median(fractions),
            "target": target_for("decode", name, config)}


def prefill_workload(model_dir: str, name: str, config: str, args) -> dict:
    tokens = args.prefill_tokens
    llm = make_llm(model_dir, config, 1, tokens + 8, max_batched_tokens=max(4096, tokens),
                   enable_prefix_caching=False)
    engine, model_config = llm.engine, llm.engine.model_config
    run_engine(engine, make_prompts(1, 64, model_config.vocab_size, seed=99), 1)  # warm-up
    # The GEMM floor is measured after every repeat (a shared host drifts); each repeat's fraction uses
    # its own floor, and the figure is the median of the repeats' fractions.
    samples, repeats = [], []
    kinds = FLOOR_KINDS.get(config, [config])
    for repeat in range(args.repeats):
        records = run_engine(engine, make_prompts(1, tokens, model_config.vocab_size, seed=repeat), 1)
        assert len(records) == 1 and records[0].num_tokens == tokens, "the prompt must be one step"
        samples.append(records[0].seconds)
        repeats.append({kind: matmul_floor(kind, model_config, tokens, 1, 1) for kind in kinds})
        best_s = min(f["seconds"] for f in repeats[-1].values())
        log(f"  {name} {config} prefill repeat {repeat + 1}/{args.repeats}: {samples[-1]:.2f} s, GEMM floor "
            f"{best_s:.2f} s, fraction {best_s / samples[-1]:.2f}")
    del llm, engine
    gc.collect()
    floors = {kind: sorted((r[kind] for r in repeats), key=lambda f: f["seconds"])[len(repeats) // 2]
              for kind in kinds}  # per kind, the median repeat's floor
    best = min(floors.values(), key=lambda f: f["seconds"])
    fractions = [min(f["seconds"] for f in r.values()) / s for r, s in zip(repeats, samples)]
    step_s = statistics.median(samples)
    flops = linear_flops(model_config, tokens, 1) + attention_flops(model_config, [tokens], [tokens])
    return {"kind": "prefill", "model": name, "config": config, "prompt_len": tokens, **summary(samples),
            "step_s": step_s, "tokens_per_s": tokens / step_s, "model_flops": flops,
            "engine_flop_per_s": flops / step_s, "matmul_floors": floors, "floor_kind": best["kind"],
            "floor_s": best["seconds"], "limit": f"{best['flop_per_s'] / 1e9:.0f} GFLOP/s",
            "fraction": statistics.median(fractions), "fraction_per_repeat": fractions,
            "target": target_for("prefill", name, config)}


def offline_workload(model_dir: str, name: str, config: str, args) -> dict:
    num, prompt_len, output_len = args.offline_prompts, args.prompt_len, args.offline_tokens
    llm = make_llm(model_dir, config, num, prompt_len + output_len, enable_prefix_caching=False)
    engine, model_config = llm.engine, llm.engine.model_config
    dtype = TORCH_DTYPES[CONFIGS[config][0]]
    run_engine(engine, make_prompts(4, 16, model_config.vocab_size, seed=99), 4)  # warm-up
    runs = []
    for repeat in range(args.repeats):
        records = run_engine(engine, make_prompts(num, prompt_len, model_config.vocab_size, seed=repeat), output_len)
        runs.append(records)
        log(f"  {name} {config} offline repeat {repeat + 1}/{args.repeats}: {sum(r.seconds for r in records):.2f} s, "
            f"{num * output_len / sum(r.seconds for r in records):.1f} output tok/s")
    step_bytes = weight_bytes(engine.model)
    del llm, engine
    gc.collect()
    bw = bandwidth(step_bytes, args)
    kinds = FLOOR_KINDS.get(config, [config])

    def best_floor(rows: int, sampled: int) -> dict:  # the fastest way to run the GEMMs (FLOOR_KINDS)
        return min((matmul_floor(k, model_config, rows, sampled, args.repeats) for k in kinds),
                   key=lambda f: f["seconds"])

    decode_floor = best_floor(num, num)
    floor_s, prefill_chunks = 0.0, {}
    for record in runs[0]:
        if record.num_decodes == len(record.context_lens):  # a pure decode step
            memory_s = (step_bytes + kv_read_bytes(model_config, dtype, record.context_lens)) / bw["median"]
            compute_s = decode_floor["seconds"] * record.num_decodes / num
            floor_s += max(memory_s, compute_s)
        else:
            if record.num_tokens not in prefill_chunks:
                prefill_chunks[record.num_tokens] = best_floor(record.num_tokens, len(record.context_lens))
            floor_s += prefill_chunks[record.num_tokens]["seconds"]
    totals = [sum(r.seconds for r in records) for records in runs]
    total_s = statistics.median(totals)
    return {"kind": "offline", "model": name, "config": config, "num_prompts": num, "prompt_len": prompt_len,
            "output_len": output_len, **summary(totals), "step_s": total_s,
            "tokens_per_s": num * output_len / total_s, "weight_bytes": step_bytes, "bandwidth": bw,
            "decode_matmul_floor": decode_floor, "prefill_matmul_floors": prefill_chunks,
            "steps": [[(r.seconds, r.num_tokens, r.num_decodes) for r in records] for records in runs],
            "floor_s": floor_s, "limit": "per-step roofline", "fraction": fraction(floor_s, total_s), "target": None}


def print_table(results: list[dict], bw_big: dict) -> None:
    print(f"\nstreaming read, >= 1 GiB buffer: {bw_big['median'] / 1e9:.1f} GB/s (median of {bw_big['n']})")
    print(f"{'workload':<10}{'model':<12}{'config':<7}{'measured':>14}{'floor':>11}{'limit':>18}{'fraction':>10}"
          f"{'target':>8}  ok")
    for r in results:
        measured = f"{r['tokens_per_s']:.1f} tok/s"
        target = "" if r["target"] is None else f"{r['target']:.2f}"
        ok = "" if r["target"] is None else ("yes" if r["fraction"] >= r["target"] else "NO")
        print(f"{r['kind']:<10}{r['model']:<12}{r['config']:<7}{measured:>14}{r['floor_s'] * 1e3:>9.1f}ms"
              f"{r['limit']:>18}{r['fraction']:>10.2f}{target:>8}  {ok}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "benchmarks/results/roofline.json")
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--configs", default="fp32,bf16,int8")
    parser.add_argument("--decode-models", default="bench-1b,bench-125m")
    parser.add_argument("--prefill-models", default="bench-1b,bench-125m")
    parser.add_argument("--offline-models", default="bench-125m")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--offline-prompts", type=int, default=32)
    parser.add_argument("--offline-tokens", type=int, default=64)
    parser.add_argument("--max-buffer-gib", type=float, default=8.0, help="cap on the step-sized read buffer")
    parser.add_argument("--step-read-gib", type=float, default=1.0,
                        help="cap on the buffer read after every decode step (the step's own bytes below it)")
    args = parser.parse_args()
    if args.quick:
        args.decode_tokens, args.prefill_tokens, args.offline_prompts, args.offline_tokens = 16, 256, 8, 8
        args.decode_models, args.prefill_models = "bench-125m", "bench-125m"
    args.repeats = args.repeats or (1 if args.quick else 3)
    set_threads(args.threads)
    load_start = load_average()
    log(f"roofline: torch threads {args.threads}, load average {load_start}")
    configs = args.configs.split(",")
    bw_big = bandwidth(GiB, args)
    log(f"streaming read (1 GiB): {bw_big['median'] / 1e9:.1f} GB/s")
    plan = ([(decode_workload, m, c) for m in args.decode_models.split(",") if m for c in configs]
            + [(prefill_workload, m, c) for m in args.prefill_models.split(",") if m for c in configs]
            + [(offline_workload, m, c) for m in args.offline_models.split(",") if m for c in configs])
    results = []
    for index, (workload, model, config) in enumerate(plan):
        log(f"[{index + 1}/{len(plan)}] {workload.__name__.removesuffix('_workload')} {model} {config}")
        started = time.monotonic()
        results.append(workload(f"{args.models_dir}/{model}", model, config, args))
        r = results[-1]
        log(f"  -> {r['tokens_per_s']:.1f} tok/s, fraction of floor {r['fraction']:.2f} "
            f"({time.monotonic() - started:.0f} s)")
    bw_big_end = bandwidth(GiB, args)
    print_table(results, bw_big)
    write_json(args.out, {"config": vars(args), "environment": environment(load_start),
                          "bandwidth_1gib": bw_big, "bandwidth_1gib_end": bw_big_end, "results": results})
    save_bar_png(args.out.removesuffix(".json") + ".png",
                 f"pagoda / physical limit ({args.threads} threads, load {load_start[0]})",
                 [f"{r['kind']} {r['model']} {r['config']}" for r in results], [r["fraction"] for r in results],
                 [r["target"] for r in results], "fraction of floor (1.0 = at the limit)")


if __name__ == "__main__":
    main()
