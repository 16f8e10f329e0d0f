"""Lab: does the KV formula predict the allocator's real pool, and how many sequences it lets run at once?

The knob is the KV budget (`kv_cache_memory_bytes`). The prediction is `pagoda calc`'s: KV bytes per token
from the model's shape, the pool in whole blocks, and the sequences of a prompt length that fit in it. The
measurement is the engine's: the pool it built, and the most prompts it prefilled together when given twice as
many as the prediction allows (each asks for one token, so every request scheduled in a step ends in it).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.calc.shapes import shape_from_path
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pagoda import LLM, SamplingParams

NAME = "kv-capacity"
QUESTION = "Does the KV formula predict the real pool, and the sequences that run at once?"
MiB = 2**20
PROMPT_TOKENS = 100
UNIT_TOKENS = 341  # a third of a thousand tokens: three 100-token prompts and the blocks' rounding


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM, SamplingParams

    arch = shape_from_path(Path(model)).architecture
    assert arch is not None, f"{model}: the lab needs the model's shape (a config.json)"
    rng = random.Random(0)
    rows: list[dict[str, Cell]] = []
    # The sweep doubles from the whole MiB nearest UNIT_TOKENS tokens of this model's fp32 KV, so every model's
    # smallest pool holds a few prompts: 1 MiB for the built-in model, 15 for a 125M bench model.
    fp32_per_token = formulas.kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, "float32")
    unit_mib = max(1, round(UNIT_TOKENS * fp32_per_token / MiB))
    for budget_mib in (unit_mib * scale for scale in ((1, 2) if quick else (1, 2, 4, 8, 16))):
        llm = LLM(model, kv_cache_memory_bytes=budget_mib * MiB, max_num_seqs=1024, max_num_batched_tokens=65536)
        kv = llm.engine.describe().kv_cache
        per_token = formulas.kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv.dtype)
        predicted_blocks = math.floor(budget_mib * MiB / (per_token * kv.block_size))
        blocks_per_sequence = -(-PROMPT_TOKENS // kv.block_size)
        predicted_fit = formulas.sequences_that_fit(predicted_blocks * kv.block_size * per_token,
                                                    blocks_per_sequence * kv.block_size * per_token)
        vocab = len(llm.get_tokenizer())
        prompts = [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(2 * predicted_fit)]
        peak = _most_prefilled_at_once(llm, prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        del llm
        rows.append({"budget_mib": budget_mib, "kv_bytes_per_token": int(per_token),
                     "predicted_blocks": predicted_blocks, "pool_blocks": kv.num_blocks,
                     "predicted_sequences": predicted_fit, "peak_sequences": peak})
    holds = all(r["pool_blocks"] == r["predicted_blocks"] and r["peak_sequences"] == r["predicted_sequences"]
                for r in rows)
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("budget_mib", "KV MiB"), ("kv_bytes_per_token", "B/token"), ("predicted_blocks", "blocks calc"),
                 ("pool_blocks", "blocks real"), ("predicted_sequences", f"seqs calc ({PROMPT_TOKENS} tok)"),
                 ("peak_sequences", "seqs at once")],
        rows=rows,
        lesson=("The pool is the formula to the block: 2 x layers x KV heads x head dim x dtype bytes a token, "
                "in whole blocks. A sequence holds whole blocks too, so the prompts that run at once are the "
                "pool's blocks over each prompt's blocks, not its tokens over the prompt's tokens."),
        lesson_holds=holds,
        settings={"model": model, "prompt_tokens": PROMPT_TOKENS, "quick": quick},
    )


def _most_prefilled_at_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    """The most requests one step prefilled: each asks for one token, so each step's outputs are its prefills."""
    engine, peak = llm.engine, 0
    for index, prompt in enumerate(prompts):
        engine.add_request(f"lab-kv-{index}", prompt, params)
    while engine.has_unfinished_requests():
        peak = max(peak, sum(output.finished for output in engine.step()))
    return peak


def plot(result: LabResult, axes: Axes) -> None:
    budgets = result.column("budget_mib")
    axes.plot(budgets, result.column("predicted_sequences"), "-", label="calc: sequences that fit")
    axes.plot(budgets, result.column("peak_sequences"), "o", label="engine: prefilled at once")
    axes.set_xlabel("KV budget (MiB)")
    axes.set_ylabel(f"{PROMPT_TOKENS}-token prompts")
    axes.legend()
