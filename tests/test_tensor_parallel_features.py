"""Tensor parallelism beside the engine's other features: n-gram speculation, structured output and seeded
sampling at TP = 2 give what they give in one process (rank 0 drafts, masks and samples; the ranks only run
the forward)."""

from __future__ import annotations

import re

from conftest import random_prompts

from pagoda import SamplingParams
from pagoda.structured import StructuredOutputsParams

REPEATING = [[31, 32, 33, 34] * 4, [50, 51, 52] * 3 + [50], [7, 8] * 6]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def token_ids(outputs) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_ngram_speculation_at_tp2_changes_no_token(checkpoint, make_llm):
    model_dir = checkpoint("llama", init_std=0.1)  # greedy output loops: n-gram drafts are often right
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with make_llm(model_dir, tensor_parallel_size=2) as plain:
        expected = token_ids(plain.generate(REPEATING, params, use_tqdm=False))
    with make_llm(model_dir, tensor_parallel_size=2, speculative_config=NGRAM) as speculating:
        got = token_ids(speculating.generate(REPEATING, params, use_tqdm=False))
        stats = speculating.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    assert got == expected


def test_structured_output_and_seeded_sampling_at_tp2_match_one_process(checkpoint, make_llm):
    model_dir = checkpoint("llama")
    prompts = random_prompts([5, 9, 13], seed=3)
    pattern = r"[a-z]{2,6} [0-9]{1,3}"
    constrained = SamplingParams(temperature=0.0, max_tokens=16,
                                 structured_outputs=StructuredOutputsParams(regex=pattern))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    runs = []
    for size in (1, 2):
        with make_llm(model_dir, tensor_parallel_size=size) as llm:
            runs.append([llm.generate(prompts, params, use_tqdm=False) for params in (constrained, seeded)])
    (constrained_1, seeded_1), (constrained_2, seeded_2) = runs
    assert all(re.fullmatch(pattern, output.outputs[0].text) for output in constrained_2)
    assert token_ids(constrained_2) == token_ids(constrained_1)
    assert token_ids(seeded_2) == token_ids(seeded_1)
