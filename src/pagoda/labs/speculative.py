"""Lab: how many target steps does speculation save, and which acceptance rate predicts it?

The knob is the number of draft tokens per step, k (n-gram drafts from the prompt and output so far; k = 0 is
plain decoding). Counted: the target's steps, and the drafts' tokens proposed and accepted. Two checks hold on
every run: greedy output is the same at every k, and each accepted draft token saves exactly one target step
(steps at k = steps at 0 - accepted). The prediction is calc's tokens per step, 1 + a + ... + a^k, for a draft
token accepted with probability a. With a = accepted / proposed (the rate vLLM's metrics report) it falls
short: a draft's tokens after its first rejection count as proposed, though they never had a chance. With a
estimated as the chance of accepting the next token given the ones before it were (a truncated geometric's
estimate from the same counters), it matches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda.calc import formulas
from pagoda.labs.result import Cell, LabResult
from pagoda.text.tokenizer import encode_chat

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "speculative"
QUESTION = "How many target steps does speculation save, and which acceptance rate predicts it?"
# Two of the built-in model's task prompts, as its copy and reverse families pose them (4 words, 5 items): its
# answers repeat words of the prompt, which n-grams find.
PROMPTS = ("Copy this text: red tea oslo cat", "Reverse the list: red, tea, oslo, cat, denver")


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams

    ks, output_len = ((0, 2, 4), 64) if quick else ((0, 1, 2, 4, 8), 256)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Cell]] = []
    baseline: tuple[list[list[int]], int] | None = None
    for k in ks:
        speculative = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4} if k else None
        llm = LLM(model, speculative_config=speculative, enable_prefix_caching=False)
        prompts = [encode_chat(llm.get_tokenizer(), [{"role": "user", "content": text}]) for text in PROMPTS]
        steps_before = _steps(llm)
        # One request at a time: a step then serves one sequence, so steps saved and tokens accepted are the
        # same count (batched, one step would carry several sequences' accepted tokens).
        outputs = [list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
                   for prompt in prompts]
        steps = _steps(llm) - steps_before
        spec = llm.engine.stats().spec_decode
        del llm
        if baseline is None:
            baseline = (outputs, steps)
        drafts, proposed, accepted = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec \
            else (0, 0, 0)
        full_runs = spec.accepted_per_position[-1] if spec and spec.accepted_per_position else 0
        rate = accepted / proposed if proposed else None
        conditional = accepted / (accepted + drafts - full_runs) if drafts else None
        rows.append({
            "k": k, "steps": steps, "predicted_steps": baseline[1] - accepted, "accepted": accepted,
            "same_output": outputs == baseline[0],
            "rate": rate, "conditional_rate": conditional,
            "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
            "calc_from_rate": formulas.spec_expected_tokens(rate, k) if rate is not None else 1.0,
            "calc_from_conditional": formulas.spec_expected_tokens(conditional, k) if conditional is not None else 1.0,
        })
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("k", "k"), ("steps", "steps"), ("predicted_steps", "steps: 0 - accepted"),
                 ("same_output", "same output"), ("rate", "accepted/proposed"),
                 ("conditional_rate", "a: next given previous"), ("tokens_per_step", "tokens/drafted step"),
                 ("calc_from_rate", "calc from accepted/proposed"), ("calc_from_conditional", "calc from a")],
        rows=rows,
        lesson=("Speculation never changes greedy output, and every accepted draft token is one target step "
                "saved. calc's formula predicts tokens per step from the chance of accepting a token once the "
                "ones before it were: fed the accepted/proposed ratio instead, it falls short, since a draft's "
                "tokens after a rejection are counted as proposed but were never tried."),
        lesson_holds=all(row["same_output"] and row["steps"] == row["predicted_steps"] for row in rows),
        settings={"model": model, "prompts": list(PROMPTS), "output_tokens": output_len, "drafts": "ngram 2-4",
                  "quick": quick},
    )


def _steps(llm: Any) -> int:
    """The engine's steps so far: every step lands in one bucket of its tokens-per-step histogram."""
    return sum(llm.engine.stats().iteration_token_counts)


def plot(result: LabResult, axes: Axes) -> None:
    ks = result.column("k")
    axes.plot(ks, result.column("tokens_per_step"), "ko-", label="measured tokens per drafted step")
    axes.plot(ks, result.column("calc_from_conditional"), "s--", label="calc, a = next given previous")
    axes.plot(ks, result.column("calc_from_rate"), "^:", label="calc, a = accepted / proposed")
    axes.set_xlabel("draft tokens per step (k)")
    axes.set_ylabel("tokens per target step")
    steps = axes.twinx()
    steps.bar(ks, result.column("steps"), alpha=0.15, width=0.4, color="gray")
    steps.set_ylabel("target steps (bars)")
    axes.legend(loc="upper left", fontsize=8)
