"""Speculative decoding: decode-phase tokens/s with vs without speculation, per method and k, in one run.

Decode-phase speed is output tokens after the first over the time after the first (the prefill and the
first token are the same work with or without speculation). Every row's ratio is against the same engine
settings without speculation, measured in the same run, the two alternating `--repeats` times (default 3;
the rates are over the summed runs), so that a loaded host's drift hits both. Greedy, or seeded sampling
with n-gram drafts: both ways give the same tokens (checked).

  (a) the demo model, n-gram, batch 1, on its `copy` and `json` task prompts (outputs repeat the prompt),
      and `reverse` reported separately (its answer is the prompt backwards: lookup mostly fails);
  (b) a draft-model pair at batch 1: a bench model (`--bench-model`, default bench-125m) in fp32 with its
      own quantized copy drafting (`--draft-quantization` int8 or int4, `--draft-dtype` its activations);
      with the acceptance per position, the measured step costs and `pagoda calc`'s predicted speed-up;
  (c) random prompts (drafts mostly fail): the demo model with n-gram (sampled, seeded), the bench model
      with its draft (greedy);
  (d) the batch size above which speculation stops paying: the demo model, n-gram, copy prompts;
  (e) suffix decoding (vLLM's defaults) on every demo-model family, batch 1: each repeat a fresh engine, so the
      global index starts empty and holds only the answers of the run's earlier items, each item seen once.

    python benchmarks/speculative.py [--threads 2] [--quick]
    python benchmarks/speculative.py --sections b --bench-model bench-1b --draft-dtype float32
    python benchmarks/speculative.py --sections e --out benchmarks/results/speculative-suffix.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import add_common_args, environment, load_average, log, make_prompts, set_threads, write_json

from pagoda import LLM, SamplingParams
from pagoda.calc.formulas import spec_speedup
from pagoda.demo import DEMO_MODEL_DIR, encode_prompts
from pagoda.demo.tasks import TASKS
from pagoda.demo.tasks import generate as task_items

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix"}  # vLLM's defaults: depth 24 (and so k), spec factor 1, min token probability 0.1
# The draft's default dtype per quantization: bf16 activations keep the int8 copy's step cheap where int8's matmul
# is torch's (CPUs without pagoda's AVX-512 kernels); int4's kernel quantizes x to int8 itself.
DRAFT_DTYPES = {"int8": "bfloat16", "int4": "float32"}


def self_draft(model: Path, quantization: str, dtype: str | None) -> dict:
    """The model's own quantized copy as its draft model."""
    return {"method": "draft_model", "model": str(model), "quantization": quantization,
            "dtype": dtype or DRAFT_DTYPES[quantization]}


@dataclass
class Run:
    """One workload on one engine: decode-phase tokens/s and what speculation did."""

    decode_tokens: int
    decode_s: float
    outputs: list[list[int]]
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def acceptance(self) -> float | None:
        return sum(self.accepted_per_position) / self.num_draft_tokens if self.num_draft_tokens else None


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float, list[list[int]]]:
    """All prompts at once; the decode phase starts when every request has its first token."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    outputs: dict[str, list[int]] = {}
    decode_start = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = list(output.outputs[0].token_ids)
        if decode_start is None and len(outputs) == len(prompts) and all(outputs.values()):
            decode_start = time.perf_counter()
    end = time.perf_counter()
    ordered = [outputs[f"r{index}"] for index in range(len(prompts))]
    decode_tokens = sum(len(tokens) - 1 for tokens in ordered)
    return decode_tokens, end - (decode_start or end), ordered


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch_size: int = 1) -> Run:
    before = llm.engine.stats().spec_decode
    tokens, seconds, outputs = 0, 0.0, []
    for start in range(0, len(prompts), batch_size):
        t, s, o = run_batch(llm, prompts[start : start + batch_size], params)
        tokens, seconds, outputs = tokens + t, seconds + s, outputs + o
    after = llm.engine.stats().spec_decode
    if after is None or before is None:
        return Run(tokens, seconds, outputs)
    per_position = tuple(a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position))
    return Run(tokens, seconds, outputs, after.num_drafts - before.num_drafts,
               after.num_draft_tokens - before.num_draft_tokens, per_position)


def compare(base_llm: LLM, spec_llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int,
            batch_size: int = 1) -> tuple[Run, Run]:
    """Without and with speculation, alternating, `repeats` times (a loaded host drifts): summed runs."""
    runs = [(measure(base_llm, prompts, params, batch_size), measure(spec_llm, prompts, params, batch_size))
            for _ in range(repeats)]
    return _total([base for base, _ in runs]), _total([spec for _, spec in runs])


def _total(runs: list[Run]) -> Run:
    per_position = tuple(sum(values) for values in zip(*(run.accepted_per_position for run in runs)))
    return Run(sum(r.decode_tokens for r in runs), sum(r.decode_s for r in runs), runs[0].outputs,
               sum(r.num_drafts for r in runs), sum(r.num_draft_tokens for r in runs), per_position)


def engine(model: Path | str, speculative: dict | None, **options) -> LLM:
    """An engine, warmed up (first forwards allocate and pick kernels) on a request of its own."""
    options.setdefault("max_model_len", 1024)
    options.setdefault("num_kv_blocks", 2048)
    llm = LLM(str(model), speculative_config=speculative, **options)
    llm.generate([[11, 12, 13, 11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    return llm


def row(section: str, workload: str, method: str, k: int | None, base: Run, spec: Run | None,
        batch_size: int = 1, **extra) -> dict:
    result = {"section": section, "workload": workload, "method": method, "k": k, "batch_size": batch_size,
              "baseline_tokens_per_s": round(base.tokens_per_s, 2)}
    if spec is not None:
        assert spec.outputs == base.outputs, f"{workload} {method} k={k}: speculation changed the output"
        result.update(tokens_per_s=round(spec.tokens_per_s, 2), speedup=round(spec.tokens_per_s / base.tokens_per_s, 3),
                      acceptance=None if spec.acceptance is None else round(spec.acceptance, 3),
                      mean_accepted_length=round(1 + sum(spec.accepted_per_position) / max(spec.num_drafts, 1), 3),
                      accepted_per_position=list(spec.accepted_per_position), num_drafts=spec.num_drafts)
    result.update(extra)
    candidates = f" c={extra['first_token_candidates']}" if extra.get("first_token_candidates") else ""
    log(f"{section} {workload:>8} {method:>11} k={k}{candidates} batch={batch_size}: "
        + ", ".join(f"{key} {value}" for key, value in result.items() if key in ("speedup", "acceptance",
                                                                               "baseline_tokens_per_s", "predicted")))
    return result


def demo_prompts(llm: LLM, task: str, count: int) -> list[list[int]]:
    return encode_prompts(llm.get_tokenizer(), task_items(task, "test", count))


def section_a_and_c(args, ks: list[int]) -> list[dict]:
    """The demo model with n-gram: its task families, and random prompts."""
    greedy = SamplingParams(temperature=0.0, max_tokens=args.demo_max_tokens)
    plain = engine(DEMO_MODEL_DIR, None)
    workloads = {task: demo_prompts(plain, task, args.prompts) for task in ("copy", "json", "reverse")}
    workloads["random"] = make_prompts(args.prompts, 48, plain.engine.model_config.vocab_size, seed=1)
    # Sampled (seeded: n-gram speculation gives the very same tokens), so the text does not fall into the
    # loops greedy decoding of random prompts does, where lookup would do well.
    random_params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.demo_max_tokens, ignore_eos=True)
    rows = []
    for name, prompts in workloads.items():
        params = random_params if name == "random" else greedy
        section = "c" if name == "random" else "a"
        for k in ks:
            spec_llm = engine(DEMO_MODEL_DIR, {**NGRAM, "num_speculative_tokens": k})
            rows.append(row(section, name, "ngram", k, *compare(plain, spec_llm, prompts, params, args.repeats)))
    return rows


def section_b_and_c(args, ks: list[int], model: Path) -> list[dict]:
    """A bench model in fp32 with its quantized copy drafting: step costs, acceptance, the calc prediction."""
    params = SamplingParams(temperature=0.0, max_tokens=args.bench_max_tokens, ignore_eos=True)
    prompts = make_prompts(args.bench_prompts, 32, 32000, seed=2)
    random_prompts = make_prompts(args.bench_prompts, 32, 32000, seed=3)
    draft = self_draft(model, args.draft_quantization, args.draft_dtype)
    target = engine(model, None, num_kv_blocks=256)
    draft_alone = engine(model, None, num_kv_blocks=256, quantization=draft["quantization"], dtype=draft["dtype"])
    target_alone, draft_run = compare(target, draft_alone, prompts, params, args.repeats)
    draft_cost = target_alone.tokens_per_s / draft_run.tokens_per_s
    log(f"draft step / target step at batch 1: {draft_cost:.3f}")
    rows = []
    for k in ks:
        for candidates in args.candidates:
            options = {"num_speculative_tokens": k, "first_token_candidates": candidates}
            spec_llm = engine(model, {**draft, **options}, num_kv_blocks=256)
            base, spec = compare(target, spec_llm, prompts, params, args.repeats)
            alpha = spec.acceptance or 0.0
            # k draft forwards a step: one over the step's kept tokens (which samples the first draft), k - 1
            # more. Alternatives add rows to the target's step, not forwards; a kept one counts as accepted.
            predicted = spec_speedup(alpha, k, draft_cost)
            rows.append(row("b", "bench", "draft_model", k, base, spec, draft_cost=round(draft_cost, 3),
                            predicted=round(predicted, 3), first_token_candidates=candidates))
    best = max(rows, key=lambda r: r["speedup"])  # the settings one would deploy for this draft
    options = {"num_speculative_tokens": best["k"], "first_token_candidates": best["first_token_candidates"]}
    spec_llm = engine(model, {**draft, **options}, num_kv_blocks=256)
    rows.append(row("c", "bench-random", "draft_model", best["k"],
                    *compare(target, spec_llm, random_prompts, params, args.repeats),
                    first_token_candidates=best["first_token_candidates"]))
    return rows


def section_d(args, k: int) -> list[dict]:
    """Total decode throughput at growing batch sizes, n-gram, with vs without: on copy prompts (drafts
    mostly right) and random sampled ones (mostly wrong)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=args.demo_max_tokens)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=args.demo_max_tokens, ignore_eos=True)
    plain = engine(DEMO_MODEL_DIR, None)
    spec_llm = engine(DEMO_MODEL_DIR, {**NGRAM, "num_speculative_tokens": k})
    vocab_size = plain.engine.model_config.vocab_size
    rows = []
    for batch_size in args.batch_sizes:
        count = max(batch_size, args.prompts)  # in batches of batch_size
        copy = demo_prompts(plain, "copy", count)
        rows.append(row("d", "copy", "ngram", k, *compare(plain, spec_llm, copy, greedy, args.repeats, batch_size),
                        batch_size))
        random = make_prompts(count, 48, vocab_size, seed=1)
        rows.append(row("d", "random", "ngram", k, *compare(plain, spec_llm, random, sampled, args.repeats,
                                                            batch_size), batch_size))
    return rows


def section_e(args) -> list[dict]:
    """Suffix decoding on each demo-model family, batch 1, greedy: a fresh engine per repeat (empty indexes)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=args.demo_max_tokens)
    plain = engine(DEMO_MODEL_DIR, None)
    rows = []
    for task in TASKS:
        prompts = demo_prompts(plain, task, args.prompts)
        runs = []
        for _ in range(args.repeats):
            spec_llm = engine(DEMO_MODEL_DIR, SUFFIX)
            runs.append((measure(plain, prompts, greedy), measure(spec_llm, prompts, greedy)))
            spec_llm.close()
        k = spec_llm.engine.speculator.config.num_speculative_tokens if spec_llm.engine.speculator else None
        rows.append(row("e", task, "suffix", k, _total([b for b, _ in runs]), _total([s for _, s in runs])))
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'':2} {'workload':>12} {'method':>11} {'k':>2} {'c':>2} {'batch':>5} {'base tok/s':>10} " \
             f"{'spec tok/s':>10} {'speedup':>7} {'accept':>6} {'len':>5} {'pred':>5}"
    print(header)
    for r in rows:
        print(f"{r['section']:2} {r['workload']:>12} {r['method']:>11} {r['k']:>2} "
              f"{r.get('first_token_candidates') or '':>2} {r['batch_size']:>5} "
              f"{r['baseline_tokens_per_s']:>10.1f} {r.get('tokens_per_s', 0):>10.1f} {r.get('speedup', 0):>7.2f} "
              f"{r.get('acceptance') or 0:>6.2f} {r.get('mean_accepted_length', 0):>5.2f} "
              f"{r.get('predicted', 0):>5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, str(REPO_ROOT / "benchmarks" / "results" / "speculative.json"))
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per demo workload (run one at a time)")
    parser.add_argument("--demo-max-tokens", type=int, default=96)
    parser.add_argument("--bench-prompts", type=int, default=2)
    parser.add_argument("--bench-max-tokens", type=int, default=48)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--bench-model", default="bench-125m", help="section b's model, under models/")
    parser.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None,
                        help="section b's draft activations (default: bfloat16 for int8, float32 for int4)")
    parser.add_argument("--draft-quantization", choices=sorted(DRAFT_DTYPES), default="int8",
                        help="section b's draft: the bench model's own copy in this quantization")
    parser.add_argument("--candidates", type=int, nargs="+", default=[1],
                        help="section b: first_token_candidates values, each run at every k")
    parser.add_argument("--sections", default="abcde")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.demo_max_tokens, args.bench_prompts, args.bench_max_tokens = 2, 48, 1, 16
        args.batch_sizes = [1, 4]
    args.repeats = args.repeats or 3
    set_threads(args.threads)
    load_at_start = load_average()
    rows: list[dict] = []
    if "a" in args.sections or "c" in args.sections:
        rows += section_a_and_c(args, args.ks)
    bench_model = MODELS_DIR / args.bench_model
    if "b" in args.sections and bench_model.is_dir():
        rows += section_b_and_c(args, args.ks, bench_model)
    elif "b" in args.sections:
        log(f"{bench_model} missing (python scripts/make_bench_models.py --only {args.bench_model}): "
            "section b skipped")
    if "d" in args.sections:
        rows += section_d(args, args.ks[-1])
    if "e" in args.sections:
        rows += section_e(args)
    print_table(rows)
    paying = {workload: [r["batch_size"] for r in rows if r["section"] == "d" and r["workload"] == workload
                         and r.get("speedup", 0) >= 1.0] for workload in ("copy", "random")}
    write_json(args.out, {"rows": rows,
                          "largest_paying_batch_size": {w: max(b, default=None) for w, b in paying.items()},
                          "settings": {k: v for k, v in vars(args).items() if k != "out"},
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    sys.exit(main())
