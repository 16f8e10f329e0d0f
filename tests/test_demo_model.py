"""The shipped demo model through pagoda: greedy output equal to `transformers`, the task families the
model card reports at >= 90% answered correctly (a sample of the held-out set; benchmarks/quality.py
runs all 10,000 items), and its chat template's tool form, whose calls the server's hermes parser reads."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.demo import DEMO_MODEL_DIR, encode_prompts, transformers_greedy
from pagoda.demo.tasks import TOOLS, held_out_set, is_correct, tool_call_text
from pagoda.server.tool_parsers import HermesParser
from pagoda.text.tokenizer import render_chat

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
    assert correct["sort"] >= ITEMS_PER_FAMILY - 3, correct  # 95% over 1,000 items
    assert correct["scope"] == ITEMS_PER_FAMILY, correct
    assert correct["multiturn"] >= ITEMS_PER_FAMILY - 2 and correct["recall"] >= ITEMS_PER_FAMILY - 2, correct


TOOL_MARKERS = ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_template_without_tools_is_plain_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Count the items: a"}]
    assert render_chat(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nCount the items: a<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_renders_tools_calls_and_results_in_the_hermes_form(tokenizer):
    add = TOOLS[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                {"role": "tool", "tool_call_id": "call_2", "content": "2"}]
    assert render_chat(tokenizer, messages, tools=[add]) == (
        "<|im_start|>system\nBe brief.\n\n<tools>\n" + json.dumps(add["function"]) + "\n</tools>\n"
        "To use one, reply with a JSON call in <tool_call></tool_call> tags.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # No system message of its own: the tools make one; an assistant's text comes before its calls.
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure.",
                       "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]}],
                       add_generation_prompt=False, tools=[add])
    assert text.startswith("<|im_start|>system\n<tools>\n")
    assert text.endswith('<|im_start|>assistant\nSure.\n<tool_call>\n{"name": "add", "arguments": {}}\n'
                         "</tool_call><|im_end|>\n")


def test_tool_markers_are_single_tokens_kept_when_decoding(tokenizer):
    for marker in TOOL_MARKERS:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and marker not in tokenizer.all_special_tokens, marker
    call = tool_call_text("get_weather", {"city": "Oslo"})
    assert tokenizer.decode(tokenizer.encode(call, add_special_tokens=False), skip_special_tokens=True) == call


def test_tool_calls_parse_into_the_right_call(items_and_prompts):
    """The server's hermes parser reads the model's calls (held-out questions, tools offered) as the calls
    the answers name: what `tool_choice: "auto"` returns as `tool_calls`."""
    tokenizer, items, prompts = items_and_prompts
    tool_items = [(item, prompt) for item, prompt in zip(items, prompts)
                  if item.task == "tool" and item.answer.startswith("<tool_call>")]
    outputs = LLM(str(DEMO_MODEL_DIR), num_kv_blocks=512).generate(
        [prompt for _, prompt in tool_items], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    right = 0
    for (item, _), output in zip(tool_items, outputs):
        parsed = HermesParser().parse(output.outputs[0].text, finished=True)
        expected = json.loads(item.answer.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        right += (parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
                  == [(expected["name"], expected["arguments"])])
    assert tool_items and right >= len(tool_items) - 1, (right, len(tool_items))
