"""Batch-1 decode tokens/s of each architecture family at one shape, beside Llama's: what a family's own layers
cost (Gemma's sandwich norms and GeGLU, OLMo 2's post-norms, Phi-3's partial rotary) over Llama's.

Each family gets a seeded random checkpoint of bench-125m's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
intermediate 1536, vocab 32000), written to a temporary directory; rates are `decode_targets.decode_rate`'s
(the engine's steps after the prefill), in rounds that visit every family in turn, the median of --repeats rounds,
and each family's ratio to Llama's.

    python benchmarks/arch_decode.py --threads 2 --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_common_args, environment, load_average, log, set_threads, write_json
from decode_targets import decode_rate

SHAPE = dict(vocab_size=32000, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
             max_position_embeddings=4096, init_std=0.02)
HEAD_DIM = 64


def family_overrides(arch: str, num_layers: int) -> dict[str, Any]:
    """The test checkpoints' quirks at the bench shape (their tiny-model sizes replaced)."""
    if arch in ("gemma2", "gemma3"):
        overrides: dict[str, Any] = dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=4096)
        if arch == "gemma3":  # Gemma 3's five local layers to one global
            overrides["num_hidden_layers"] = num_layers  # (the test checkpoint fixes 3)
            overrides["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                        for i in range(num_layers)]
        return overrides
    if arch == "phi3":  # Phi-4-mini's rope: 3/4 of each head, LongRoPE
        rotated_pairs = int(HEAD_DIM * 0.75) // 2
        return dict(original_max_position_embeddings=4096, rope_parameters={
            "rope_type": "longrope", "partial_rotary_factor": 0.75, "short_factor": [1.0] * rotated_pairs,
            "long_factor": [2.0] * rotated_pairs})
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="llama,gemma2,gemma3,olmo2,phi3")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--out-len", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=SHAPE["num_layers"])
    add_common_args(parser, "benchmarks/results/arch-decode.json")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 5)
    set_threads(args.threads)
    from pagoda import LLM
    from pagoda.testing import make_checkpoint

    load_at_start, results = load_average(), []
    shape = {**SHAPE, "num_layers": args.num_layers}
    archs = args.archs.split(",")
    with tempfile.TemporaryDirectory() as root:
        engines = {}
        for arch in archs:
            model_dir = make_checkpoint(Path(root) / arch, arch, **shape, **family_overrides(arch, args.num_layers))
            engines[arch] = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=1,
                                max_model_len=args.prompt_len + args.out_len + 16)
        # Rounds visit every family in turn, so that a drifting host hits them alike; medians are reported.
        rates: dict[str, list[float]] = {arch: [] for arch in archs}
        for round_index in range(args.repeats):
            for arch in archs:
                rates[arch].append(decode_rate(engines[arch], 1, args.prompt_len, args.out_len, 1, round_index,
                                               time.perf_counter))
            log(f"round {round_index + 1}/{args.repeats}: "
                + ", ".join(f"{arch} {rates[arch][-1]:.1f}" for arch in archs))
        for arch, llm in engines.items():
            backend = llm.engine.model.backend
            results.append({"arch": arch, "backend": type(backend).__name__,
                            "native_decode_stack": getattr(backend, "decode_runner", None) is not None,
                            "decode_tokens_per_s": statistics.median(rates[arch]), "runs": rates[arch]})
        del engines
        gc.collect()
    llama = next((r["decode_tokens_per_s"] for r in results if r["arch"] == "llama"), None)
    for result in results:
        result["vs_llama"] = None if llama is None else result["decode_tokens_per_s"] / llama
        log(f"{result['arch']:7} {result['decode_tokens_per_s']:7.1f} decode tokens/s"
            + ("" if llama is None else f"  ({result['vs_llama']:.2f} x llama)")
            + f"  {result['backend']}" + (" + native decode stack" if result["native_decode_stack"] else ""))
    write_json(args.out, {"settings": vars(args), "results": results, "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
