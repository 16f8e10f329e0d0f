"""Lab: how long does a long prompt stall the streams already decoding, and what does chunking it cost?

The knob is the step's token budget (`max_num_batched_tokens`), from one that takes the whole prompt in a step
(chunked prefill in effect off, as in vLLM with a budget of the context length) down to small chunks, with
the step-time cap off (`max_step_ms=0`) so that the schedule depends on counts alone. The workload: a few
streams decoding, then one long prompt arrives. Every stream waits for the whole step, so the step's tokens
are its stall. The prediction is calc's: decodes take their one token each first, the prompt gets the rest,
so the largest step a stream waits on is min(budget, decodes + prompt) tokens, the prompt's first token
comes after ceil(prompt / (budget - decodes)) steps, and no stream ever misses a step. Counted: the tokens of
every step a stream decoded in, the steps the prompt took, each stream's largest gap in steps; the step
times are reported, not checked.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pagoda import LLM

NAME = "interference"
QUESTION = "How long does a long prompt stall the decoding streams, and what does chunking it cost?"
UNCHUNKED_BUDGET = 2048  # more than streams + prompt: the whole prompt goes in one step
STREAM_PROMPT_TOKENS = 8
DECODE_STEPS_BEFORE = 3  # steps the streams decode alone before the prompt arrives


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM

    budgets, num_streams, prompt_len = ((UNCHUNKED_BUDGET, 128, 32), 4, 384) if quick else \
        ((UNCHUNKED_BUDGET, 512, 256, 128, 64, 32, 16), 8, 384)
    # Streams long enough to decode through their own prefill steps at the smallest budget, then the slowest
    # prefill of the sweep, and a little past it.
    own_prefill_steps = -(-num_streams * STREAM_PROMPT_TOKENS // min(budgets))
    stream_len = (own_prefill_steps + DECODE_STEPS_BEFORE
                  + max(_predicted_steps(prompt_len, b, num_streams) for b in budgets) + 4)
    rows: list[dict[str, Cell]] = []
    for budget in budgets:
        llm = LLM(model, max_num_batched_tokens=budget, max_step_ms=0, enable_prefix_caching=False,
                  max_num_seqs=num_streams + 1)
        measured = _measure(llm, num_streams, stream_len, prompt_len)
        del llm
        rows.append({
            "budget": budget, "chunked": "yes" if budget < num_streams + prompt_len else "no",
            "predicted_stall_tokens": min(budget, num_streams + prompt_len), "stall_tokens": measured["stall_tokens"],
            "predicted_prefill_steps": _predicted_steps(prompt_len, budget, num_streams),
            "prefill_steps": measured["prefill_steps"], "gap_steps": measured["gap_steps"],
            "stall_ms": measured["stall_ms"], "decode_ms": measured["decode_ms"],
        })
    holds = all(row["stall_tokens"] == row["predicted_stall_tokens"]
                and row["prefill_steps"] == row["predicted_prefill_steps"] and row["gap_steps"] == 1 for row in rows)
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("budget", "budget"), ("chunked", "chunked"), ("predicted_stall_tokens", "stall tokens calc"),
                 ("stall_tokens", "stall tokens real"), ("predicted_prefill_steps", "prompt steps calc"),
                 ("prefill_steps", "prompt steps real"), ("gap_steps", "max gap (steps)"),
                 ("stall_ms", "stall ms"), ("decode_ms", "decode step ms")],
        rows=rows,
        lesson=("A decoding stream never misses a step: its stall is the size of the steps it waits on. Unchunked, "
                "one step carries the whole prompt and every stream waits for it; a budget of B tokens caps that "
                "step at B, and the prompt pays instead, its first token ceil(prompt / (B - decodes)) steps "
                "away. The budget trades the streams' worst gap against the newcomer's time to first token."),
        lesson_holds=holds,
        settings={"model": model, "streams": num_streams, "stream_prompt_tokens": STREAM_PROMPT_TOKENS,
                  "stream_tokens": stream_len, "prompt_tokens": prompt_len, "max_step_ms": 0, "quick": quick},
    )


def _predicted_steps(prompt_len: int, budget: int, num_streams: int) -> int:
    steps = formulas.chunked_prefill_steps(prompt_len, budget, num_streams)
    assert steps is not None, f"a budget of {budget} leaves no room beside {num_streams} decodes"
    return steps


def _measure(llm: LLM, num_streams: int, stream_len: int, prompt_len: int) -> dict[str, Cell]:
    from pagoda import SamplingParams

    engine, rng = llm.engine, random.Random(0)  # the same prompts at every budget
    vocab = len(llm.get_tokenizer())
    for index in range(num_streams):
        engine.add_request(f"stream-{index}", [rng.randrange(10, vocab) for _ in range(STREAM_PROMPT_TOKENS)],
                           SamplingParams(max_tokens=stream_len, ignore_eos=True))
    long_prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
    sampled_at: dict[str, list[int]] = {}  # request id -> the steps it got a token in
    step_tokens: list[int] = []
    step_seconds: list[float] = []
    arrival = None  # the step the long prompt arrives at: once every stream has decoded alone for a few steps,
    # so that no stream's own prefill shares the budget with it (at a small budget the streams prefill over
    # several steps)
    while engine.has_unfinished_requests():
        if arrival is None and len(sampled_at) == num_streams \
                and min(map(len, sampled_at.values())) > DECODE_STEPS_BEFORE:
            arrival = len(step_tokens)
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        before, started = engine.stats().iteration_tokens_sum, time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - started)
        step_tokens.append(engine.stats().iteration_tokens_sum - before)
        for output in outputs:
            sampled_at.setdefault(output.request_id, []).append(len(step_tokens) - 1)
    assert arrival is not None, "the streams finished before the long prompt arrived"
    streams = [steps for request_id, steps in sampled_at.items() if request_id != "long"]
    decode_steps = sorted({step for steps in streams for step in steps[1:]})  # steps in which a stream decoded
    stall = max(decode_steps, key=lambda step: step_tokens[step])
    quiet = [step_seconds[step] for step in decode_steps if step_tokens[step] == num_streams]
    return {
        "stall_tokens": step_tokens[stall], "prefill_steps": sampled_at["long"][0] - arrival + 1,
        "gap_steps": max(b - a for steps in streams for a, b in zip(steps, steps[1:])),
        "stall_ms": 1e3 * step_seconds[stall], "decode_ms": 1e3 * sorted(quiet)[len(quiet) // 2],
    }


def plot(result: LabResult, axes: Axes) -> None:
    budgets = result.column("budget")
    axes.plot(budgets, result.column("predicted_stall_tokens"), "-", label="calc: stall (tokens in the step)")
    axes.plot(budgets, result.column("stall_tokens"), "o", label="engine: largest step a stream waited on")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("step token budget (max_num_batched_tokens)")
    axes.set_ylabel("tokens")
    steps = axes.twinx()
    steps.plot(budgets, result.column("predicted_prefill_steps"), "--", color="C2", label="calc: prompt's steps")
    steps.plot(budgets, result.column("prefill_steps"), "s", color="C2", label="engine: prompt's steps")
    steps.set_ylabel("steps to the long prompt's first token")
    handles = axes.get_legend_handles_labels()[0] + steps.get_legend_handles_labels()[0]
    axes.legend(handles=handles, loc="center right", fontsize=8)
