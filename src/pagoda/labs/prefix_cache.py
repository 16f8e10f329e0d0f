"""Lab: how much prefill does a shared prefix save, and where does the time saved differ from the tokens saved?

The knob is prefix caching, off and on, over requests that share a system prompt and differ after it. The
prediction is `pagoda calc`'s: only whole blocks of the shared prefix are reused, and never the prompt's last
token, so each request after the first computes `prompt - floor(min(prefix, prompt - 1) / block) x block`
tokens. The measurement counts the prompt tokens the engine computed (the prompt less `num_cached_tokens`)
and times the prefills. The first request runs alone, so that the others find its blocks cached.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "prefix-cache"
QUESTION = "How much prefill does a shared prefix save, in tokens and in time?"


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams

    num_requests, prefix_len, suffix_len = (8, 200, 20) if quick else (32, 400, 40)
    rows: list[dict[str, Cell]] = []
    for caching in (False, True):
        llm = LLM(model, enable_prefix_caching=caching, max_num_batched_tokens=8192)
        block = llm.engine.describe().kv_cache.block_size
        vocab = len(llm.get_tokenizer())
        rng = random.Random(0)  # the same prompts in both runs
        shared = [rng.randrange(10, vocab) for _ in range(prefix_len)]
        prompts = [shared + [rng.randrange(10, vocab) for _ in range(suffix_len)] for _ in range(num_requests)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts[:1], params, use_tqdm=False)
        outputs += llm.generate(prompts[1:], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        prompt_len = prefix_len + suffix_len
        reused = formulas.prefix_reusable_tokens(prompt_len, prefix_len, block) if caching else 0
        rows.append({
            "prefix_caching": caching,
            "prompt_tokens": num_requests * prompt_len,
            "predicted_computed": prompt_len + (num_requests - 1) * (prompt_len - reused),
            "computed": sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs),
            "seconds": seconds,
        })
        del llm
    off, on = rows
    on["token_ratio"] = _ratio(off["computed"], on["computed"])
    on["time_ratio"] = _ratio(off["seconds"], on["seconds"])
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("prefix_caching", "caching"), ("prompt_tokens", "prompt tokens"),
                 ("predicted_computed", "computed calc"), ("computed", "computed real"), ("seconds", "seconds"),
                 ("token_ratio", "tokens saved x"), ("time_ratio", "time saved x")],
        rows=rows,
        lesson=("The cache skips exactly the whole blocks of the shared prefix (the last prompt token is always "
                "computed). Time falls by less than tokens: each prefill still attends over the whole prefix, "
                "and every step has a fixed cost the tokens saved do not remove."),
        lesson_holds=all(row["computed"] == row["predicted_computed"] for row in rows),
        settings={"model": model, "requests": num_requests, "prefix_tokens": prefix_len,
                  "suffix_tokens": suffix_len, "quick": quick},
    )


def _ratio(numerator: Cell, denominator: Cell) -> float:
    assert isinstance(numerator, (int, float)) and isinstance(denominator, (int, float))
    return numerator / denominator


def plot(result: LabResult, axes: Axes) -> None:
    labels = ["caching off", "caching on"]
    positions = range(len(result.rows))
    predicted, measured = result.column("predicted_computed"), result.column("computed")
    axes.bar([p - 0.2 for p in positions], predicted, width=0.4, label="calc: tokens computed")
    axes.bar([p + 0.2 for p in positions], measured, width=0.4, label="engine: tokens computed")
    axes.set_xticks(list(positions), labels)
    axes.set_ylabel("prompt tokens computed")
    seconds = axes.twinx()
    seconds.plot(list(positions), result.column("seconds"), "ko-", label="seconds")
    seconds.set_ylabel("seconds (prefills)")
    axes.legend(loc="upper right")
