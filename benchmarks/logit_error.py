"""Logit error of the fast numeric paths (bf16, int8 W8A16, int4 W4A16) against fp32, on the bench models.

The bench models have random weights: their logits are nearly tied, so greedy agreement says little
about them (the demo model's task accuracy is the quality gate: benchmarks/quality.py). What this
reports is the size of the numeric error itself: the same prompts through pagoda in fp32, bf16, int8
and int4 (kernels on where the CPU has them, as served), and max / mean |logit - fp32 logit| over every
vocabulary entry at each prompt's last position, beside the fp32 logits' own spread (their standard
deviation) for scale. The last position is computed twice: inside one prefill of all prompts (matrix
multiplications), and alone after its cached prefix, as a batch-1 decode step computes a token (the GEMV kernels).

    python benchmarks/logit_error.py [--models bench-125m,bench-1b] [--configs bf16,int8,int4] [--prompts 32]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from common import add_common_args, environment, load_average, log, make_llm, make_prompts, set_threads, write_json

from pagoda import SamplingParams


def last_position_logits(model_dir: str, config: str, prompts: list[list[int]], alone: bool = False) -> torch.Tensor:
    """[num_prompts, vocab] fp32 logits at each prompt's last position, as the engine computes them: in one
    prefill step, or (alone) each last position computed by itself after its prompt's cached prefix, a
    one-token step as batch-1 decode runs it (the native decode stack; int8: x quantized to int16)."""
    llm = make_llm(model_dir, config, num_seqs=1 if alone else len(prompts), max_len=max(map(len, prompts)) + 1,
                   enable_prefix_caching=alone)
    model, captured, step_tokens = llm.engine.model, [], []
    compute_logits, forward = model.compute_logits, model.forward

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        captured.append(logits.float().clone())
        return logits

    def counting_forward(input_ids, *args):
        step_tokens.append(input_ids.numel())
        return forward(input_ids, *args)

    def measured(batch: list[list[int]]) -> None:
        model.compute_logits, model.forward = capture, counting_forward
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        del model.compute_logits, model.forward  # back to the class's methods
        assert all(len(o.outputs[0].token_ids) == 1 for o in outputs)

    if alone:
        for prompt in prompts:
            llm.generate([prompt[:-1]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the prefix
            measured([prompt])
    else:
        measured(prompts)
    logits = torch.cat(captured)
    assert logits.shape[0] == len(prompts), "one sampling row per prompt"
    expected_steps = [1] * len(prompts) if alone else [sum(map(len, prompts))]
    assert step_tokens == expected_steps, f"steps computed {step_tokens[:4]}..., expected {expected_steps[:4]}..."
    return logits  # the engine goes with this frame: main() collects it before loading the next


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "benchmarks/results/logit_error.json")
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--models", default="bench-125m,bench-1b")
    parser.add_argument("--configs", default="bf16,int8,int4", help="paths compared with fp32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    set_threads(args.threads)
    load_at_start = load_average()
    results = []
    for name in args.models.split(","):
        model_dir = f"{args.models_dir}/{name}"
        vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
        # prompt_len + 1 tokens: alone, the cached prefix is prompt_len tokens, whole blocks of 16.
        prompts = make_prompts(args.prompts, args.prompt_len + 1, vocab, seed=7)
        for step, alone in (("prefill", False), ("decode, batch 1", True)):
            log(f"{name} {step}: fp32 reference")
            reference = last_position_logits(model_dir, "fp32", prompts, alone)
            gc.collect()
            for config in args.configs.split(","):
                log(f"{name} {step}: {config}")
                error = (last_position_logits(model_dir, config, prompts, alone) - reference).abs()
                gc.collect()
                results.append({"model": name, "config": config, "step": step, "positions": len(prompts),
                                "vocab": vocab, "max_abs_error": error.max().item(),
                                "mean_abs_error": error.mean().item(), "fp32_logit_std": reference.std().item(),
                                "fp32_logit_max_abs": reference.abs().max().item()})
    print(f"\n{'model':12s} {'step':16s} {'path':6s} {'max |err|':>10s} {'mean |err|':>11s} {'fp32 std':>9s}")
    for r in results:
        print(f"{r['model']:12s} {r['step']:16s} {r['config']:6s} {r['max_abs_error']:10.4f} "
              f"{r['mean_abs_error']:11.4f} {r['fp32_logit_std']:9.3f}")
    write_json(args.out, {"config": vars(args), "environment": environment(load_at_start), "results": results})


if __name__ == "__main__":
    main()
