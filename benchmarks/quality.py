"""Task accuracy of the demo model per numeric path, through pagoda's engine, beside `transformers`.

    .venv/bin/python benchmarks/quality.py                          # every path, 1,000 items per task
    .venv/bin/python benchmarks/quality.py --limit 100 --paths fp32  # a quick look
    .venv/bin/python benchmarks/quality.py --paths fp32,fp32+kv-int8,fp32+kv-fp8 \
        --out benchmarks/results/quality-kv.json                    # the quantized KV caches
    ... --reference-cache /tmp/quality-reference.pt                 # the transformers run once for all three

The held-out set (pagoda.demo.tasks.held_out_set) is never trained on. Every path decodes greedily the
same chat-formatted token ids. `transformers` (fp32) is the reference: the fp32 path must produce
exactly its tokens (a divergence is tolerated only at a near-tie, where the two tokens' reference logits
differ by < 1e-3 * max(1, |logit|), and counted); bf16 and int8 are judged by accuracy, with their
agreement reported. The speculative paths (fp32 with n-gram drafts, and with the model's own int8 copy
as a draft model) must give fp32's answers token for token. A quantized KV cache (int8, fp8) is compared item by
item with the same model dtype's own KV: it fails a family when the items it gets wrong that the other got right
outnumber the reverse beyond chance (an exact one-sided McNemar test, at 5% across the families).
Writes benchmarks/results/quality.json.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from provenance import write_result
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagoda.demo import DEMO_MODEL_DIR, encode_prompts, transformers_greedy
from pagoda.demo.tasks import Item, held_out_set, is_correct

REFERENCE = "transformers"
# Engine options per path; a path the engine cannot run yet is skipped, and the table says why.
ENGINE_PATHS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "int4-sym": {"dtype": "float32", "quantization": "int4", "quantization_config": {"sym": True}},
    "int4-rtn": {"dtype": "float32", "quantization": "int4", "quantization_config": {"search": False}},
    "int4-g128": {"dtype": "float32", "quantization": "int4", "quantization_config": {"group_size": 128}},
    # Speculation must not change a greedy answer: these are compared token for token with fp32.
    "fp32+ngram": {"dtype": "float32", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    "fp32+draft": {"dtype": "float32", "speculative_config": {
        "method": "draft_model", "model": "{model}", "quantization": "int8", "num_speculative_tokens": 3}},
    # A quantized KV cache is judged against its model dtype's path, item by item (paired_loss).
    "fp32+kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "fp32+kv-fp8": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "fp32+kv-fp8-scaled": {"dtype": "float32", "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
}
SPECULATIVE_BASE = "fp32"
# The chance, over all families together, that the gate fails a quantized KV cache that costs nothing.
KV_FAMILYWISE_ALPHA = 0.05


def paired_loss(base: list[bool], other: list[bool]) -> dict[str, float]:
    """McNemar's exact test on one family's items, scored on two paths: `lost` right on base and wrong on
    other, `gained` the reverse, and p, the one-sided chance of `lost` or more of the lost + gained items
    that differ if each were equally likely to fall either way (items both paths score alike say nothing
    about which is better)."""
    assert len(base) == len(other)
    lost = sum(b and not o for b, o in zip(base, other))
    gained = sum(o and not b for b, o in zip(base, other))
    split = lost + gained
    p = sum(math.comb(split, k) for k in range(lost, split + 1)) / 2**split
    return {"lost": lost, "gained": gained, "p": p}


def significant_losses(paired: dict[str, dict[str, float]], familywise_alpha: float) -> list[str]:
    """The families whose loss is beyond chance, Bonferroni-corrected: each is tested at alpha / families, so
    a path that costs nothing fails with probability at most alpha however many families there are."""
    return [task for task, test in paired.items() if test["p"] < familywise_alpha / len(paired)]


def kv_base(path: str) -> str | None:
    """The path a quantized-KV path is compared with: the same options with the model dtype's KV."""
    options = ENGINE_PATHS[path]
    if "kv_cache_dtype" not in options:
        return None
    rest = {k: v for k, v in options.items() if k not in ("kv_cache_dtype", "calculate_kv_scales")}
    return next(p for p, o in ENGINE_PATHS.items() if o == rest)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--paths", default=",".join(ENGINE_PATHS), help=f"comma-separated, of {sorted(ENGINE_PATHS)}")
    parser.add_argument("--limit", type=int, default=1000, help="held-out items per task family")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quality.json")
    parser.add_argument("--reference-cache", type=Path, default=None,
                        help="keep the transformers reference's outputs here and reuse them while the weights, "
                             "prompts, --max-tokens and library versions are the same")
    return parser.parse_args()


def run_transformers(model_dir: Path, prompts: list[list[int]], tokenizer: Any, max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_greedy(model, tokenizer.pad_token_id, prompts, max_new_tokens=max_tokens)


def reference_key(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> str:
    """What the reference's outputs depend on: the weights, the prompts, the token budget, the libraries."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((model_dir / name).read_bytes())
    digest.update(repr((prompts, max_tokens, torch.__version__, transformers.__version__)).encode())
    return digest.hexdigest()


def cached_reference(args: argparse.Namespace, prompts: list[list[int]],
                     tokenizer: Any) -> tuple[list[list[int]], float]:
    """The reference's outputs and the seconds they took, from --reference-cache when it matches."""
    key = reference_key(args.model, prompts, args.max_tokens)
    cache = args.reference_cache
    if cache is not None and cache.is_file():
        stored = torch.load(cache)
        if stored["key"] == key:
            print(f"{REFERENCE}: outputs from {cache} (computed in {stored['seconds']:.0f} s)", flush=True)
            return stored["outputs"], stored["seconds"]
    start = time.perf_counter()
    outputs = run_transformers(args.model, prompts, tokenizer, args.max_tokens)
    seconds = time.perf_counter() - start
    if cache is not None:
        torch.save({"key": key, "outputs": outputs, "seconds": seconds}, cache)
    return outputs, seconds


def run_pagoda(model_dir: Path, prompts: list[list[int]], options: dict, args: argparse.Namespace) -> list[list[int]]:
    from pagoda import LLM, SamplingParams

    # Explicit pool: ample for max_num_seqs sequences of ~200 tokens, and small (this model's KV is tiny).
    speculative = options.get("speculative_config")
    if speculative is not None:  # the draft is the model's own int8 copy
        options = {**options, "speculative_config": {k: str(model_dir) if v == "{model}" else v
                                                     for k, v in speculative.items()}}
    llm = LLM(str(model_dir), num_kv_blocks=4096, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=4096, **options)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def near_tie_divergences(model_dir: Path, prompts: list[list[int]], ours: list[list[int]],
                         reference: list[list[int]]) -> tuple[int, int]:
    """(near-tie, real) counts among the sequences where `ours` differs from the reference: a divergence
    is a near-tie when the two tokens' reference logits differ by < 1e-3 * max(1, |logit|)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    near, real = 0, 0
    for prompt, mine, ref in zip(prompts, ours, reference):
        if mine == ref:
            continue
        at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
        if at >= min(len(mine), len(ref)):  # one is a prefix of the other: a stop decision, not a tie
            real += 1
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ref[:at]])).logits[0, -1]
        ours_logit, ref_logit = logits[mine[at]].item(), logits[ref[at]].item()
        tie = abs(ours_logit - ref_logit) < 1e-3 * max(1.0, abs(ref_logit))
        near, real = near + tie, real + (not tie)
    return near, real


def strip_eos(token_ids: list[int], eos_id: int) -> list[int]:
    return token_ids[:-1] if token_ids and token_ids[-1] == eos_id else token_ids


def correctness(items: list[Item], outputs: list[list[int]], tokenizer: Any) -> dict[str, list[bool]]:
    """Per family, whether each item (in held-out order) was answered right."""
    texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    correct: dict[str, list[bool]] = {}
    for item, text in zip(items, texts):
        correct.setdefault(item.task, []).append(is_correct(item, text))
    return correct


def score(correct: dict[str, list[bool]]) -> dict[str, float]:
    return {task: round(100 * sum(flags) / len(flags), 2) for task, flags in correct.items()}


def print_table(results: dict[str, dict], tasks: list[str]) -> None:
    paths = [p for p, r in results.items() if "accuracy" in r]
    print(f"\n{'task':12s}" + "".join(f"{p:>14s}" for p in paths))
    for task in [*tasks, "mean"]:
        row = "".join(f"{results[p]['accuracy'][task]:13.1f}%" for p in paths)
        print(f"{task:12s}{row}")
    print(f"{'items/s':12s}" + "".join(f"{results[p]['items_per_second']:14.1f}" for p in paths))
    for path, result in results.items():
        if "skipped" in result:
            print(f"{path}: skipped ({result['skipped']})")
        elif "agreement" in result:
            a = result["agreement"]
            print(f"{path}: {a['identical']}/{a['items']} outputs token-identical to {REFERENCE}"
                  + (f" ({a['near_tie']} near-tie, {a['real']} real divergences)" if "real" in a else ""))


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := [p for p in paths if p not in ENGINE_PATHS]:
        sys.exit(f"unknown path(s) {unknown}; expected some of {sorted(ENGINE_PATHS)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sets = held_out_set(args.limit)
    items = [item for task_items in sets.values() for item in task_items]
    prompts = encode_prompts(tokenizer, items)
    eos = tokenizer.eos_token_id
    print(f"{len(items)} held-out items ({args.limit} per task) from {args.model}", flush=True)

    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    correct: dict[str, dict[str, list[bool]]] = {}
    for path in [REFERENCE, *paths]:
        start = time.perf_counter()
        try:
            if path == REFERENCE:
                raw, seconds = cached_reference(args, prompts, tokenizer)
            else:
                raw = run_pagoda(args.model, prompts, ENGINE_PATHS[path], args)
                seconds = time.perf_counter() - start
        except (TypeError, ValueError, NotImplementedError) as error:  # an option the engine lacks
            if path == REFERENCE:
                raise
            print(f"{path}: skipped: {error}", flush=True)
            results[path] = {"skipped": str(error)}
            continue
        outputs[path] = [strip_eos(ids, eos) for ids in raw]
        correct[path] = correctness(items, outputs[path], tokenizer)
        accuracy = score(correct[path])
        accuracy["mean"] = round(sum(accuracy.values()) / len(accuracy), 2)
        results[path] = {"accuracy": accuracy, "seconds": round(seconds, 1),
                         "items_per_second": round(len(items) / seconds, 1)}
        print(f"{path}: mean {accuracy['mean']:.1f}% in {seconds:.0f} s", flush=True)
        if path != REFERENCE:
            identical = sum(a == b for a, b in zip(outputs[path], outputs[REFERENCE]))
            agreement: dict[str, int] = {"items": len(items), "identical": identical}
            if path == "fp32":  # the exact contract: every divergence must be a near-tie
                near, real = near_tie_divergences(args.model, prompts, outputs[path], outputs[REFERENCE])
                agreement |= {"near_tie": near, "real": real}
            if "speculative_config" in ENGINE_PATHS[path] and SPECULATIVE_BASE in outputs:
                agreement["identical_to_" + SPECULATIVE_BASE] = sum(
                    a == b for a, b in zip(outputs[path], outputs[SPECULATIVE_BASE]))
            results[path]["agreement"] = agreement
            if (base := kv_base(path)) in results and "accuracy" in results[base]:
                deltas = {task: round(value - results[base]["accuracy"][task], 2)
                          for task, value in accuracy.items() if task != "mean"}
                results[path]["family_delta_vs_" + base] = deltas
                paired = {task: paired_loss(correct[base][task], correct[path][task]) for task in correct[base]}
                results[path]["paired_vs_" + base] = paired
                results[path]["significant_losses"] = significant_losses(paired, KV_FAMILYWISE_ALPHA)

    print_table(results, list(sets))
    report = {"model": str(args.model), "items_per_task": args.limit, "max_tokens": args.max_tokens,
              "threads": args.threads, "torch": torch.__version__, "paths": results}
    write_result(args.out, report)
    print(f"\nwrote {args.out}")
    fp32 = results.get("fp32", {}).get("agreement", {})
    speculation_changed = [path for path in paths if results[path].get("agreement", {}).get(
        "identical_to_" + SPECULATIVE_BASE, len(items)) != len(items)]
    if speculation_changed:
        print(f"speculation changed greedy answers: {speculation_changed}")
    for path in paths:
        for task, test in next((v for k, v in results[path].items() if k.startswith("paired_vs_")), {}).items():
            if test["lost"] or test["gained"]:
                print(f"{path} {task}: {test['lost']} items lost, {test['gained']} gained, p = {test['p']:.2g}")
    kv_outside = [path for path in paths if results[path].get("significant_losses")]
    if kv_outside:
        print(f"a quantized KV cache costs a family beyond chance: "
              f"{ {path: results[path]['significant_losses'] for path in kv_outside} }")
    # A real fp32 divergence from transformers, speculation changing an answer, or a quantized KV cache
    # costing a family beyond chance, is a bug.
    return 1 if fp32.get("real") or speculation_changed or kv_outside else 0


if __name__ == "__main__":
    sys.exit(main())
