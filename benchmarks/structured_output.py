"""Structured outputs: what a constraint costs, on bench-125m (pagoda.testing.schema_suite's cases).

  decode   one decode step's median time, constrained vs unconstrained, at batch 1 and 16: 128-token prompts,
           128 new tokens at temperature 1 (seeded, ignore_eos), `--repeats` times. The constrained requests
           follow RECORDS, an array of 1,000 records that cannot end within max_tokens, so both take the same
           steps. Two engines on the same model, one constrained, are stepped in turn (both see the same
           machine); only steps in which every request decodes count.
  compile  each case's cold compile on a fresh grammar backend for the model's tokenizer, and its first
           mask (what the first request with a new constraint pays before its first token); plus building
           the backend (and its first, trivial grammar), which the engine does on its first constrained request.
  ttft     time to first token of a request whose grammar is already compiled (cached) vs an unconstrained
           one, same prompt, prefix caching off, alternating; per case and over all cases.

Targets (reported, not asserted): decode overhead <= 10% at both batch sizes; a cached grammar adds <= 5 ms
to TTFT.

    python benchmarks/structured_output.py [--threads 2] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from common import (
    add_common_args,
    environment,
    load_average,
    log,
    make_llm,
    make_prompts,
    set_threads,
    summary,
    write_json,
)

from pagoda import SamplingParams
from pagoda.model.loader import load_model_config
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask
from pagoda.structured.llguidance_backend import LLGuidanceBackend
from pagoda.testing.schema_suite import ALL_CASES
from pagoda.text.tokenizer import load_tokenizer

RECORDS = StructuredOutputsParams(
    json={
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["name", "id"],
            "additionalProperties": False,
        },
        "minItems": 1000,
        "maxItems": 1000,
    }
)
TARGETS = {"decode_overhead_at_most": 0.10, "ttft_added_ms_at_most": 5.0}


def add_requests(llm, prompts: list[list[int]], new_tokens: int, constraint: StructuredOutputsParams | None) -> None:
    for index, prompt in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=index, max_tokens=new_tokens, ignore_eos=True,
                                structured_outputs=constraint)
        llm.engine.add_request(f"decode-{time.monotonic_ns()}-{index}", prompt, params)


def timed_step(llm, batch: int) -> float | None:
    """One engine step: its seconds when every request of the batch decoded in it, else None."""
    scheduler = llm.engine.scheduler
    decoding = scheduler.num_running == batch and scheduler.num_waiting == 0
    decoding = decoding and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
    started = time.perf_counter()
    outputs = llm.engine.step()
    elapsed = time.perf_counter() - started
    for output in outputs:
        if output.finished:  # RECORDS cannot end within max_tokens
            assert output.outputs[0].finish_reason == "length", output.outputs[0].text
    return elapsed if decoding else None


def decode_workload(args, batch: int) -> dict:
    """Two engines on the same model, one constrained, one not, stepped in turn: both see the same machine."""
    engines = {mode: make_llm(args.model, args.config, batch, args.prompt_len + args.new_tokens)
               for mode in ("unconstrained", "constrained")}
    constraints = {"unconstrained": None, "constrained": RECORDS}
    vocab = engines["unconstrained"].engine.model_config.vocab_size
    steps: dict[str, list[float]] = {mode: [] for mode in engines}
    for repeat in range(-1, args.repeats):  # -1: warm-up (compiles RECORDS), not recorded
        prompts = make_prompts(batch, args.prompt_len if repeat >= 0 else 16, vocab, seed=repeat)
        for mode, llm in engines.items():
            add_requests(llm, prompts, args.new_tokens if repeat >= 0 else 4, constraints[mode])
        order = list(engines)
        while any(llm.engine.has_unfinished_requests() for llm in engines.values()):
            order.reverse()
            for mode in order:
                elapsed = timed_step(engines[mode], batch)
                if elapsed is not None and repeat >= 0:
                    steps[mode].append(elapsed)
    del engines
    gc.collect()
    plain, constrained = statistics.median(steps["unconstrained"]), statistics.median(steps["constrained"])
    return {"batch": batch, "unconstrained_step_s": plain, "constrained_step_s": constrained,
            "overhead": constrained / plain - 1, "steps": {mode: summary(samples) for mode, samples in steps.items()}}


def compile_workload(args) -> dict:
    """Cold compile and first mask of every case, each on a fresh backend per repeat."""
    tokenizer, config = load_tokenizer(args.model), load_model_config(args.model)
    eos_ids = sorted({*config.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
    build, compiles, masks = [], {c.name: [] for c in ALL_CASES}, {c.name: [] for c in ALL_CASES}
    for _ in range(args.repeats):
        started = time.perf_counter()
        backend = LLGuidanceBackend(tokenizer, config.vocab_size, eos_ids)
        bitmask = allocate_bitmask(1, backend.vocab_size)
        backend.compile(StructuredOutputsParams(regex="x")).matcher().fill_bitmask(bitmask, 0)
        build.append(time.perf_counter() - started)
        for case in ALL_CASES:
            started = time.perf_counter()
            grammar = backend.compile(case.params())
            compiled = time.perf_counter()
            grammar.matcher().fill_bitmask(bitmask, 0)
            compiles[case.name].append(compiled - started)
            masks[case.name].append(time.perf_counter() - compiled)
    return {"backend_build_s": statistics.median(build),
            "cases": {c.name: {"kind": c.params().kind, "compile_s": statistics.median(compiles[c.name]),
                               "first_mask_s": statistics.median(masks[c.name])} for c in ALL_CASES}}


def first_token_seconds(llm, prompt: list[int], constraint: StructuredOutputsParams | None) -> float:
    """add_request -> the step that returns the first token; the request is then aborted."""
    engine, request_id = llm.engine, f"ttft-{time.monotonic_ns()}"
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=64, structured_outputs=constraint)
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
        pass
    elapsed = time.perf_counter() - started
    engine.abort_request(request_id)
    return elapsed


def ttft_workload(args) -> dict:
    llm = make_llm(args.model, args.config, 1, args.ttft_prompt_len + 64, enable_prefix_caching=False)
    prompt = make_prompts(1, args.ttft_prompt_len, llm.engine.model_config.vocab_size, seed=7)[0]
    for case in ALL_CASES:  # compiled now: every measured request finds its grammar cached
        llm.engine.structured.compile(case.params())
    for _ in range(3):
        first_token_seconds(llm, prompt, None)
    cases = {}
    for case in ALL_CASES:
        plain, constrained = [], []
        for repeat in range(args.ttft_repeats):
            pair = [(plain, None), (constrained, case.params())]
            for samples, constraint in pair if repeat % 2 == 0 else pair[::-1]:
                samples.append(first_token_seconds(llm, prompt, constraint))
        started = time.perf_counter()  # the grammar work alone: two cache hits (validate, add), a matcher, a mask
        llm.engine.structured.compile(case.params())
        matcher = llm.engine.structured.compile(case.params()).matcher()
        llm.engine.structured.fill_bitmask([matcher])
        work = time.perf_counter() - started
        cases[case.name] = {"grammar_work_s": work, "unconstrained_s": statistics.median(plain),
                            "constrained_s": statistics.median(constrained),
                            "added_s": statistics.median(c - p for c, p in zip(constrained, plain))}
    del llm
    gc.collect()
    added = [row["added_s"] for row in cases.values()]
    return {"prompt_len": args.ttft_prompt_len, "median_added_s": statistics.median(added), "max_added_s": max(added),
            "median_unconstrained_s": statistics.median(row["unconstrained_s"] for row in cases.values()),
            "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/bench-125m")
    parser.add_argument("--config", default="fp32", help="fp32, bf16 or int8 (see common.CONFIGS)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ttft-prompt-len", type=int, default=32)
    parser.add_argument("--ttft-repeats", type=int, default=7, help="request pairs per case")
    add_common_args(parser, "benchmarks/results/structured_output.json")
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.ttft_repeats, args.repeats = 16, 3, args.repeats or 1
    args.repeats = args.repeats or 3
    set_threads(args.threads)
    load_at_start = load_average()

    log("compile: each case, cold")
    compiled = compile_workload(args)
    decode = []
    for batch in (int(b) for b in args.batches.split(",")):
        log(f"decode: batch {batch}")
        decode.append(decode_workload(args, batch))
        log(f"  {decode[-1]['unconstrained_step_s'] * 1e3:.1f} ms -> {decode[-1]['constrained_step_s'] * 1e3:.1f} ms")
    log("ttft: cached grammar vs none")
    ttft = ttft_workload(args)

    print(f"\n{args.model} ({args.config}, {args.threads} threads)")
    print(f"{'decode step':<28s} {'unconstrained':>14s} {'constrained':>12s} {'overhead':>9s} {'target':>7s}")
    for row in decode:
        print(f"{'batch ' + str(row['batch']):<28s} {row['unconstrained_step_s'] * 1e3:>11.1f} ms "
              f"{row['constrained_step_s'] * 1e3:>9.1f} ms {row['overhead']:>+8.1%} {'<= 10%':>7s}")
    print(f"\n{'TTFT, cached grammar':<28s} {'unconstrained':>14s} {'added':>12s} {'target':>17s}")
    print(f"{'median over cases':<28s} {ttft['median_unconstrained_s'] * 1e3:>11.1f} ms "
          f"{ttft['median_added_s'] * 1e3:>+9.2f} ms {'<= 5 ms':>17s}")
    print(f"{'worst case':<28s} {'':>14s} {ttft['max_added_s'] * 1e3:>+9.2f} ms")
    print(f"\ngrammar backend build (first constrained request): {compiled['backend_build_s'] * 1e3:.0f} ms")
    print(f"{'case':<24s} {'cold compile':>12s} {'first mask':>11s} {'cached: grammar work':>21s} {'TTFT added':>11s}")
    for name, row in compiled["cases"].items():
        cached = ttft["cases"][name]
        print(f"{name:<24s} {row['compile_s'] * 1e3:>9.2f} ms {row['first_mask_s'] * 1e6:>8.0f} us "
              f"{cached['grammar_work_s'] * 1e6:>18.0f} us {cached['added_s'] * 1e3:>+8.2f} ms")

    met = {"decode": all(row["overhead"] <= TARGETS["decode_overhead_at_most"] for row in decode),
           "ttft": ttft["median_added_s"] * 1e3 <= TARGETS["ttft_added_ms_at_most"]}
    write_json(args.out, {"model": args.model, "config": args.config, "prompt_len": args.prompt_len,
                          "new_tokens": args.new_tokens, "repeats": args.repeats, "decode": decode,
                          "compile": compiled, "ttft": ttft, "targets": TARGETS, "met": met,
                          "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
