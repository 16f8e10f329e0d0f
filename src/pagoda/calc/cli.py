"""`pagoda calc`: argparse wiring.

The main CLI calls add_parser(subparsers); `python -m pagoda.calc` calls main().
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from pagoda.calc.deployment import CalcInputs
from pagoda.calc.presets import (
    GPU_PRESETS,
    MODEL_CONFIGS,
    NVLINK_HOP_US,
    PCIE_HOP_US,
    THIS_MACHINE,
    resolve_gpu,
    resolve_model,
)
from pagoda.calc.render import render_json, render_text
from pagoda.calc.report import build_report
from pagoda.calc.shapes import GpuSpec

DESCRIPTION = (
    "Napkin math for serving a model on a GPU: weight and KV memory, decode floors and tokens/s "
    "ceilings, prefill time, roofline, TP communication, $/M tokens, speculative decoding, prefix "
    "caching and chunked prefill. Peak figures are dense (never 2:4 sparse). GB = 10^9 B, GiB = 2^30 B."
)

EXAMPLE = "example: pagoda calc --model llama-3-70b --gpu h100-sxm --num-gpus 4 --batch 64 --seq-len 8192"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and hardware")
    model.add_argument(
        "--model",
        default="llama-3-8b",
        help="preset name, path to an HF config.json (or its directory), or a count like 70B",
    )
    model.add_argument(
        "--gpu", help=f"preset ({', '.join(GPU_PRESETS)}) or 'this-machine' to measure; default h100-sxm"
    )
    model.add_argument("--tflops", type=float, help="dense peak TFLOP/s (custom GPU, or override --gpu)")
    model.add_argument("--tbps", type=float, help="memory bandwidth in TB/s (custom GPU, or override)")
    model.add_argument("--gpu-mem-gb", type=float, help="memory per GPU in GB = 10^9 bytes")
    model.add_argument("--interconnect-gbps", type=float, help="GPU-to-GPU GB/s, one direction")
    model.add_argument("--interconnect-latency-us", type=float,
                       help=f"one hop of a small ring all-reduce, in µs (presets assume {NVLINK_HOP_US:g} on "
                            f"NVLink, {PCIE_HOP_US:g} on PCIe)")
    model.add_argument("--num-gpus", "--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    model.add_argument("--dtype", default="bf16", help="weight dtype: fp32, bf16, fp16, fp8, int8, int4 (group 32), "
                                                        "int4-g64, int4-g128")
    model.add_argument("--kv-dtype", help="KV cache dtype (default: --dtype)")
    model.add_argument("--mem-util", type=float, default=0.9, help="fraction of GPU memory usable (0.9)")

    load = parser.add_argument_group("workload")
    load.add_argument("--seq-len", type=int, default=4096, help="context length per sequence (4096)")
    load.add_argument("--batch", type=int, default=1, help="concurrent decoding sequences (1)")
    load.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens, for prefill (2048)")
    load.add_argument("--achieved-tflops", type=float, help="prefill TFLOP/s per GPU (default 50%% of peak)")
    load.add_argument("--price-per-hour", type=float, help="$ per GPU-hour -> $/M tokens")
    load.add_argument("--tokens-per-s", type=float, help="observed tok/s of the deployment -> utilization")

    tricks = parser.add_argument_group("speculation, prefix cache, chunked prefill")
    tricks.add_argument("--spec-alpha", type=float, help="draft token acceptance rate, 0..1")
    tricks.add_argument("--spec-k", type=int, default=5, help="draft tokens per step (5)")
    tricks.add_argument(
        "--spec-draft-cost", type=float, default=0.05, help="one draft step, in target steps (0.05)"
    )
    tricks.add_argument("--prefix-len", type=int, help="tokens of the prompt shared with a cached prefix")
    tricks.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (16)")
    tricks.add_argument("--token-budget", type=int, help="tokens per scheduler step (max_num_batched_tokens)")
    tricks.add_argument("--running-decodes", type=int, default=0, help="decodes sharing each step (0)")

    split = parser.add_argument_group("prefill/decode disaggregation")
    split.add_argument("--disagg", action="store_true",
                       help="the split's handoff per request (--prompt-len, --block-size; --prefix-len: tokens the "
                            "decode replica caches), its transfer time, and whether the split pays")
    split.add_argument("--kv-link-gbps", type=float, default=50.0,
                       help="GB/s between prefill and decode replicas, one direction (50: a 400 Gb/s NIC)")
    split.add_argument("--output-len", type=int, default=128, help="answer tokens per request (128)")
    split.add_argument("--request-rate", type=float, default=1.0, help="requests/s (1)")

    parser.add_argument("--json", action="store_true", help="print JSON (raw SI numbers) instead of tables")
    parser.add_argument("--list-presets", action="store_true", help="list GPU and model presets and exit")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calc",
        help="napkin math: memory, KV, latency floors, $/M tokens",
        description=DESCRIPTION,
        epilog=EXAMPLE,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def gpu_from_args(args: argparse.Namespace) -> GpuSpec:
    """--gpu picks a base (a preset, a measurement, or H100 SXM); --tflops etc. override its figures."""
    given = {
        "peak_tflops": args.tflops,
        "bandwidth_tbps": args.tbps,
        "memory_gb": args.gpu_mem_gb,
        "interconnect_gbps": args.interconnect_gbps,
        "interconnect_latency_us": args.interconnect_latency_us,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    if args.gpu is None and overrides:
        missing = [
            flag
            for flag, key in (
                ("--tflops", "peak_tflops"),
                ("--tbps", "bandwidth_tbps"),
                ("--gpu-mem-gb", "memory_gb"),
            )
            if key not in overrides
        ]
        if missing:
            raise ValueError(f"a custom GPU needs {', '.join(missing)} (or --gpu PRESET to override)")
        return GpuSpec("custom", source="given", **overrides)
    if args.gpu is not None and args.gpu.strip().lower() in THIS_MACHINE:
        from pagoda.calc.measure import measure_this_machine

        base = measure_this_machine()
    else:
        base = resolve_gpu(args.gpu or "h100-sxm")
    if not overrides:
        return base
    return replace(base, source=f"{base.source}; overridden: {', '.join(overrides)}", **overrides)


def inputs_from_args(args: argparse.Namespace) -> CalcInputs:
    return CalcInputs(
        model=resolve_model(args.model),
        gpu=gpu_from_args(args),
        num_gpus=args.num_gpus,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        seq_len=args.seq_len,
        batch=args.batch,
        prompt_len=args.prompt_len,
        achieved_tflops=args.achieved_tflops,
        mem_util=args.mem_util,
        price_per_hour=args.price_per_hour,
        tokens_per_s=args.tokens_per_s,
        spec_alpha=args.spec_alpha,
        spec_k=args.spec_k,
        spec_draft_cost=args.spec_draft_cost,
        prefix_len=args.prefix_len,
        block_size=args.block_size,
        token_budget=args.token_budget,
        running_decodes=args.running_decodes,
        disagg=args.disagg,
        kv_link_gbps=args.kv_link_gbps,
        output_len=args.output_len,
        request_rate=args.request_rate,
    )


def _presets_text() -> str:
    lines = ["GPUs (dense bf16 TFLOP/s, TB/s, GB):"]
    for key, gpu in GPU_PRESETS.items():
        lines.append(
            f"  {key:<14} {gpu.peak_tflops:>7g} TFLOP/s  {gpu.bandwidth_tbps:>6g} TB/s  "
            f"{gpu.memory_gb:>4g} GB"
        )
    lines.append(f"  {THIS_MACHINE[0]:<14} measured at call time")
    lines.append("models: " + ", ".join(MODEL_CONFIGS))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        sys.stdout.write(_presets_text())
        return 0
    try:
        report = build_report(inputs_from_args(args))
    except (ValueError, OSError) as error:
        print(f"pagoda calc: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render_json(report) if args.json else render_text(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda calc", description=DESCRIPTION, epilog=EXAMPLE)
    add_arguments(parser)
    return run(parser.parse_args(argv))
