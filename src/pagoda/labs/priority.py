"""Lab: what does a priority buy the requests that have it, and what does it cost the others?

The knob is the scheduling policy: FCFS, then priority (vLLM's: lower runs first; no aging here). The workload
is a queue that arrives at once: background requests (priority 1) first, then urgent ones (priority 0), with
fewer slots (`max_num_seqs`) than requests, so that someone waits. The prediction is the policy's own rule:
under FCFS every background request is served before any urgent one, so each urgent request's first token
comes after every background request has finished (background x urgent such pairs); under priority an urgent
request runs first, or preempts a background one, so no pair is left. The measurement counts those pairs from
the engine's per-request timeline, and shows each class's time to first token.
"""

from __future__ import annotations

import random
import statistics
from typing import TYPE_CHECKING, Any

from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# A finished request's moments (monotonic seconds): arrival, first token, last token.
Moments = tuple[float, float, float]

NAME = "priority"
QUESTION = "What does a priority buy the urgent requests, and what does it cost the rest?"
PROMPT_TOKENS = 32
URGENT, BACKGROUND = 0, 1


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams

    num_background, num_urgent, slots, output_len = (8, 4, 4, 16) if quick else (32, 8, 8, 64)
    rows: list[dict[str, Cell]] = []
    for policy in ("fcfs", "priority"):
        llm = LLM(model, scheduling_policy=policy, priority_aging_s=0.0, max_num_seqs=slots,
                  enable_prefix_caching=False)
        vocab = len(llm.get_tokenizer())
        rng = random.Random(0)  # the same prompts under both policies
        prompts = [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(num_background + num_urgent)]
        priorities = [BACKGROUND] * num_background + [URGENT] * num_urgent
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:slots], params, use_tqdm=False)  # warm-up: the first steps of an engine are slow
        # FCFS refuses a priority it would ignore: the classes are then only the order of arrival.
        outputs = llm.generate(prompts, params, use_tqdm=False,
                               priority=priorities if policy == "priority" else None)
        background = _moments([o for o, p in zip(outputs, priorities) if p == BACKGROUND])
        urgent = _moments([o for o, p in zip(outputs, priorities) if p == URGENT])
        rows.append({
            "policy": policy,
            "predicted_pairs": num_background * num_urgent if policy == "fcfs" else 0,
            "pairs": _finished_before_first_token(background, urgent),
            "urgent_ttft_ms": _median_ms(urgent, 1),
            "background_ttft_ms": _median_ms(background, 1),
            "urgent_e2e_ms": _median_ms(urgent, 2),
            "background_e2e_ms": _median_ms(background, 2),
        })
        del llm
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("policy", "policy"), ("predicted_pairs", "waits: rule"), ("pairs", "waits: real"),
                 ("urgent_ttft_ms", "urgent TTFT ms"), ("background_ttft_ms", "background TTFT ms"),
                 ("urgent_e2e_ms", "urgent E2E ms"), ("background_e2e_ms", "background E2E ms")],
        rows=rows,
        lesson=("Under FCFS an urgent request waits for every background request ahead of it; under priority it "
                "waits for none, and the background requests pay that time instead: the total work is the same, "
                "only who waits changes. (Waits: background requests that finished before an urgent one's first "
                "token, summed over urgent requests.)"),
        lesson_holds=all(row["pairs"] == row["predicted_pairs"] for row in rows),
        settings={"model": model, "background": num_background, "urgent": num_urgent, "max_num_seqs": slots,
                  "prompt_tokens": PROMPT_TOKENS, "output_tokens": output_len, "quick": quick},
    )


def _moments(outputs: list[Any]) -> list[Moments]:
    moments = []
    for output in outputs:
        timeline = output.outputs[0].timeline  # recorded for every finished request
        assert timeline is not None and timeline.first_token is not None and timeline.last_token is not None
        moments.append((timeline.arrival, timeline.first_token, timeline.last_token))
    return moments


def _finished_before_first_token(background: list[Moments], urgent: list[Moments]) -> int:
    """(background, urgent) pairs where the background request's last token came before the urgent one's
    first: the waits the policy imposed on urgent requests."""
    return sum(1 for _, _, end in background for _, start, _ in urgent if end < start)


def _median_ms(moments: list[Moments], until: int) -> float:
    """Median of arrival to the first token (until=1) or to the last (until=2), in ms."""
    return 1e3 * statistics.median(m[until] - m[0] for m in moments)


def plot(result: LabResult, axes: Axes) -> None:
    positions = range(len(result.rows))
    axes.bar([p - 0.2 for p in positions], result.column("urgent_ttft_ms"), width=0.4, label="urgent (priority 0)")
    axes.bar([p + 0.2 for p in positions], result.column("background_ttft_ms"), width=0.4,
             label="background (priority 1)")
    axes.set_xticks(list(positions), [str(row["policy"]) for row in result.rows])
    axes.set_ylabel("median time to first token (ms)")
    axes.legend(loc="upper left")
