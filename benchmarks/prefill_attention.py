"""One layer's prefill attention over the paged cache: torch's SDPA against pagoda's kernel forms.

For each model shape and prompt length, one whole prompt (causal, no window) on scattered cache slots:
torch's SDPA as the reference backend calls it (keys gathered, kv heads repeated), and pagoda's kernel in
each form this CPU has: bf16 on AMX tiles (where Linux grants them) and on vdpbf16ps, fp32 on FMAs.
The forms are interleaved round by round, so each round sees one host state; medians of the rounds.

    python benchmarks/prefill_attention.py [--threads 2] [--lengths 512,1024,2046]
"""

from __future__ import annotations

import argparse

import torch
from common import add_common_args, call_seconds, environment, load_average, log, set_threads, summary, write_json

from pagoda.kernels import cpu_kernels
from pagoda.model.attention import PrefillSeq, sdpa_prefill

SHAPES = {"bench-125m": (9, 3, 64), "bench-1b": (32, 4, 64)}  # query heads, kv heads, head_dim


def forms(kernels, q, k_cache, v_cache, slots, scale, out) -> dict:
    """name -> a call computing the layer's attention into out."""
    seq = PrefillSeq(0, q.shape[0], slots)
    calls = {"sdpa": lambda: sdpa_prefill(q, k_cache, v_cache, seq, scale, None, out)}
    if kernels is None:
        return calls
    if q.dtype == torch.bfloat16 and kernels.prefill_attention_amx:
        calls["amx"] = lambda: kernels.paged_prefill_attention_(q, k_cache, v_cache, slots, 0, scale, out)
    vector = "vdpbf16ps" if q.dtype == torch.bfloat16 else "fma"
    calls[vector] = lambda: kernels.paged_prefill_attention_(q, k_cache, v_cache, slots, 0, scale, out,
                                                             use_amx=False)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "benchmarks/results/prefill_attention.json")
    parser.add_argument("--lengths", default="512,1024,2046", help="prompt lengths (tokens)")
    args = parser.parse_args()
    set_threads(args.threads)
    repeats = args.repeats or (2 if args.quick else 5)
    load_at_start, kernels = load_average(), cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (heads, kv_heads, head_dim) in SHAPES.items():
        for length in (int(n) for n in args.lengths.split(",")):
            slots = torch.randperm(length + 64, generator=gen)[:length]
            flops = 4 * head_dim * heads * length * (length + 1) / 2  # q.k and p.v over the causal half
            for dtype in (torch.bfloat16, torch.float32):
                k_cache, v_cache = (torch.randn(length + 64, kv_heads, head_dim, generator=gen).to(dtype)
                                    for _ in range(2))
                q = torch.randn(length, heads, head_dim, generator=gen).to(dtype)
                calls = forms(kernels, q, k_cache, v_cache, slots, head_dim**-0.5, torch.empty_like(q))
                samples: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(repeats):
                    for name, call in calls.items():
                        samples[name] += call_seconds(call, 1, min_seconds=0.2)
                row = {"model": model, "tokens": length, "dtype": str(dtype).removeprefix("torch."),
                       "forms": {name: {"seconds": summary(s), "gflops": flops / summary(s)["median"] / 1e9}
                                 for name, s in samples.items()}}
                results.append(row)
                log(f"{model} {length} {row['dtype']}: " + ", ".join(
                    f"{name} {v['seconds']['median'] * 1e3:.1f} ms ({v['gflops']:.0f} GFLOP/s)"
                    for name, v in row["forms"].items()))
    write_json(args.out, {"environment": environment(load_at_start), "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
