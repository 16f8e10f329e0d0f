"""Lab: how many steps does continuous batching save over static batching, and where does the difference go?

The knob is the scheduler's batching: static (teaching only: a new batch starts once the whole previous one
has finished, `batching="static"`) and continuous (the engine's: a freed slot takes the next request at the
next step). The workload is the same in both: requests with short prompts whose output lengths are drawn
uniformly from 1..M (ignore_eos, so each request makes exactly its length), `max_num_seqs` slots, a budget
that admits a whole batch's prompts in one step, and no step-time cap, so that the schedule depends on
counts alone. A request of L tokens is in L steps. The prediction is calc's: static takes the sum of each
batch's longest answer, continuous the makespan of giving each request the slot that frees first; from the
distribution alone, (requests / slots) x E[max of `slots` lengths] against requests x E[L] / slots. The
measurement counts the engine's steps, and the slot-steps wasted: slots x steps less the requests that
sampled in each step (pagoda pads nothing, so a finished request's slot costs no compute: it idles).
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from pagoda.calc import formulas
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "static-batching"
QUESTION = "How many steps does continuous batching save over static batching, and why?"
PROMPT_TOKENS = 8


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams

    num_requests, slots, max_len = (24, 4, 48) if quick else (64, 8, 128)
    rng = random.Random(0)
    output_lens = [rng.randint(1, max_len) for _ in range(num_requests)]
    rows: list[dict[str, Cell]] = []
    series: dict[str, list[float]] = {}
    for batching in ("static", "continuous"):
        llm = LLM(model, batching=batching, max_num_seqs=slots, max_step_ms=0, enable_prefix_caching=False,
                  max_num_batched_tokens=max(2048, slots * (PROMPT_TOKENS + 1)))
        vocab = len(llm.get_tokenizer())
        prompt_rng = random.Random(1)  # the same prompts in both modes
        engine = llm.engine
        for index, length in enumerate(output_lens):
            prompt = [prompt_rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)]
            engine.add_request(f"lab-batch-{index}", prompt, SamplingParams(max_tokens=length, ignore_eos=True))
        occupancy, tokens_before, started = [], engine.stats().iteration_tokens_sum, time.perf_counter()
        while engine.has_unfinished_requests():
            occupancy.append(len(engine.step()))  # one output per request that sampled this step
        seconds = time.perf_counter() - started
        tokens_computed = engine.stats().iteration_tokens_sum - tokens_before
        del llm, engine
        steps = len(occupancy)
        predicted = (formulas.static_batching_steps if batching == "static"
                     else formulas.continuous_batching_steps)(output_lens, slots)
        rows.append({
            "batching": batching, "napkin_steps": _napkin_steps(batching, num_requests, slots, max_len),
            "predicted_steps": predicted, "steps": steps,
            "predicted_wasted": slots * predicted - sum(output_lens), "wasted": slots * steps - sum(occupancy),
            "tokens_computed": tokens_computed, "tokens_per_s": sum(output_lens) / seconds,
        })
        series[batching] = [float(n) for n in occupancy]
    static, continuous = rows
    holds = (all(row["steps"] == row["predicted_steps"] and row["wasted"] == row["predicted_wasted"] for row in rows)
             and static["tokens_computed"] == continuous["tokens_computed"]
             and _number(continuous["steps"]) < _number(static["steps"]))
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("batching", "batching"), ("napkin_steps", "steps: from M"), ("predicted_steps", "steps calc"),
                 ("steps", "steps real"), ("predicted_wasted", "idle slot-steps calc"),
                 ("wasted", "idle slot-steps real"), ("tokens_computed", "tokens computed"),
                 ("tokens_per_s", "output tok/s")],
        rows=rows,
        lesson=("Static batching lasts as long as each batch's longest answer, so every shorter answer leaves its "
                "slot idle until then; continuous batching refills a slot the step after it frees, and serves the "
                "same tokens, computed the same, in fewer steps. The wider the spread of output lengths, the "
                "larger the gap: E[max of a batch] grows with the batch while E[length] does not."),
        lesson_holds=holds,
        settings={"model": model, "requests": num_requests, "max_num_seqs": slots, "max_output_tokens": max_len,
                  "prompt_tokens": PROMPT_TOKENS, "output_lens": output_lens, "quick": quick},
        series=series,
    )


def _napkin_steps(batching: str, num_requests: int, slots: int, max_len: int) -> float:
    """The expected steps from the length distribution alone (uniform 1..max_len), not the lengths drawn."""
    if batching == "static":
        return -(-num_requests // slots) * formulas.expected_batch_max_uniform(max_len, slots)
    return num_requests * (max_len + 1) / 2 / slots


def _number(value: Any) -> float:
    assert isinstance(value, (int, float))
    return float(value)


def plot(result: LabResult, axes: Axes) -> None:
    for batching, occupancy in result.series.items():
        axes.step(range(1, len(occupancy) + 1), occupancy, where="post", label=f"{batching}: {len(occupancy)} steps")
    axes.set_xlabel("engine step")
    axes.set_ylabel("requests decoding (slots in use)")
    axes.set_ylim(0, result.settings["max_num_seqs"] + 0.5)
    axes.set_yticks(range(result.settings["max_num_seqs"] + 1))
    axes.legend(loc="lower left")
