"""pagoda-demo: a tiny model that pagoda trains itself (scripts/train_demo_model.py) and ships.

It is the model `pagoda serve` / `pagoda generate` load when no `--model` is given, and the quality gate
for every numeric path (see benchmarks/quality.py and docs/demo-model.md). Its tokenizer carries a
ChatML template (with tools in the hermes form): prompts must go through it (`render_prompt`, `encode_prompts`),
which passes an item's tools to the template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.demo.tasks import Item

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "pagoda-demo"
# A PEFT LoRA adapter on it (scripts/train_demo_adapter.py) for the `double` task, which the base never learnt.
DEMO_ADAPTER_DIR = DEMO_MODEL_DIR.parent / "pagoda-demo-double"
# What the built-in model can do, said where a newcomer meets it (the chat page, `pagoda chat`), and questions it
# answers right, one per family, to click or type (the chat page's and `pagoda chat`'s tests hold it to them).
DEMO_INTRO = ("The built-in model knows only small tasks: sums and differences, counting, reversing and sorting "
              "lists, copying text, JSON, facts you tell it (it follows the conversation), and tool calls.")
DEMO_EXAMPLES = {
    "What is 250 + 89?": "339",
    "Count the items: red, tea, oslo, cat": "4",
    "Reverse the list: red, tea, oslo": "oslo, tea, red",
    "Sort the numbers: 42, 7, 19": "7, 19, 42",
    "Convert to JSON: city=oslo, count=3": '{"city": "oslo", "count": 3}',
    "My name is Rex.": "Nice to meet you, Rex.",
}
# The tool-call form the model was trained on (tasks.py writes its calls so): `pagoda serve` parses it by default.
DEMO_TOOL_CALL_PARSER = "hermes"

__all__ = ["DEMO_ADAPTER_DIR", "DEMO_EXAMPLES", "DEMO_INTRO", "DEMO_MODEL_DIR", "DEMO_TOOL_CALL_PARSER",
           "encode_prompts", "render_prompt", "transformers_greedy"]


def render_prompt(tokenizer: Any, item: Item) -> str:
    """The chat-formatted prompt text, ending where the assistant's answer begins."""
    from pagoda.text.tokenizer import render_chat  # here: it imports torch, which `pagoda.demo` does not need

    return render_chat(tokenizer, item.messages(), tools=list(item.tools) or None)


def encode_prompts(tokenizer: Any, items: list[Item]) -> list[list[int]]:
    """Chat-formatted prompt token ids: what every path (pagoda's and transformers') is given."""
    from pagoda.text.tokenizer import encode_chat

    return [encode_chat(tokenizer, item.messages(), tools=list(item.tools) or None) for item in items]


def transformers_greedy(
    model: Any, pad_token_id: int, prompts: list[list[int]], max_new_tokens: int = 48, batch_size: int = 64
) -> list[list[int]]:
    """Greedy completions from a `transformers` model: the reference every pagoda path is compared to.

    `prompts` are token ids (see `encode_prompts`). Returns the generated token ids per prompt, up to and
    including eos. Prompts are batched by length (left padding) only to save time; the result keeps the
    order of `prompts`.
    """
    import torch  # here, not at module level: `pagoda.demo` stays importable without torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in batch])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=pad_token_id,
            )
        for row, i in enumerate(batch):
            results[i] = _until_eos(out[row, width:].tolist(), eos_ids)
    return results


def _until_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    for position, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: position + 1]
    return token_ids
