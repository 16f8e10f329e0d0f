"""The shipped demo model through pagoda: greedy output equal to `transformers`, and the task families the
model card reports at >= 90% answered correctly (a sample of the held-out set; benchmarks/quality.py
runs all 8,000 items)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.demo import DEMO_MODEL_DIR, encode_prompts, transformers_greedy
from pagoda.demo.tasks import held_out_set, is_correct

ITEMS_PER_FAMILY = 12


@pytest.fixture(scope="module")
def items_and_prompts():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    items = [item for family in held_out_set(ITEMS_PER_FAMILY).values() for item in family]
    return tokenizer, items, encode_prompts(tokenizer, items)


def test_pagoda_greedy_equals_transformers_on_every_family(items_and_prompts):
    tokenizer, items, prompts = items_and_prompts
    reference = transformers_greedy(LlamaForCausalLM.from_pretrained(DEMO_MODEL_DIR).eval(),
                                    tokenizer.pad_token_id, prompts)
    outputs = LLM(str(DEMO_MODEL_DIR), num_kv_blocks=512).generate(
        prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference


def test_families_reported_at_90_percent_are_answered(items_and_prompts):
    tokenizer, items, prompts = items_and_prompts
    outputs = LLM(str(DEMO_MODEL_DIR), num_kv_blocks=512).generate(
        prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    correct: dict[str, int] = {}
    for item, output in zip(items, outputs):
        correct[item.task] = correct.get(item.task, 0) + is_correct(item, output.outputs[0].text)
    assert correct["counting"] == correct["reverse"] == ITEMS_PER_FAMILY, correct
    assert correct["sort"] >= ITEMS_PER_FAMILY - 3, correct  # 91% over 1,000 items
