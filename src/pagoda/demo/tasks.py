"""Synthetic, checkable tasks for the demo model: the families, the train/test split, exact-match scoring.

Pure Python (no torch), deterministic from a seed. Every item carries a canonical `key` naming the problem
(not its wording); the split is a hash of that key, so a held-out problem never reaches training under
any phrasing, and the two splits need not be generated together to stay disjoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagoda.demo.conversations import multiturn, recall, with_history
from pagoda.demo.families import (
    SCOPE_ANSWER,
    TEST_BUCKETS,
    Message,
    Problem,
    addition,
    copying,
    counting,
    doubling,
    facts,
    in_test_split,
    reversing,
    scope,
    sorting,
    subtraction,
    to_json,
)
from pagoda.demo.tool_tasks import TOOLS, tool, tool_call_text, tool_result

SYSTEM_PROMPTS = (
    "You are pagoda-demo, a tiny model that solves small, checkable tasks.",
    "Answer with the result only.",
    "You are a helpful assistant.",
)


@dataclass(frozen=True)
class Item:
    task: str
    key: str  # canonical problem, independent of wording: decides the split
    prompt: str
    answer: str
    system: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool definitions offered to the model (the tool families)
    turns: tuple[Message, ...] = ()  # messages after the prompt: the assistant's call, the tool's result
    history: tuple[Message, ...] = ()  # earlier exchanges of the conversation

    def messages(self) -> list[Message]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": self.prompt}, *self.turns]


def is_correct(item: Item, output: str) -> bool:
    """Exact match after trimming surrounding whitespace (a trailing newline is not an error)."""
    return output.strip() == item.answer


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "addition": addition,
    "subtraction": subtraction,
    "counting": counting,
    "reverse": reversing,
    "sort": sorting,
    "copy": copying,
    "json": to_json,
    "facts": facts,
    "scope": scope,
    "tool": tool,
    "tool_result": tool_result,
    "multiturn": multiturn,
    "recall": recall,
}

# Tasks an adapter teaches, not the base model: held out like the others, but never in its training mix or in
# `held_out_set` (the base model's quality gate).
ADAPTER_TASKS: dict[str, Callable[[random.Random], Problem]] = {"double": doubling}
_FAMILIES = {**TASKS, **ADAPTER_TASKS}


def _item(task: str, problem: Problem, system: str | None) -> Item:
    return Item(task, problem.key, problem.prompt, problem.answer, system, problem.tools, problem.turns,
                problem.history)


def generate(task: str, split: str, count: int, seed: int = 0, system_rate: float = 0.0) -> list[Item]:
    """`count` distinct problems of one family from one split; deterministic in (task, split, seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
    # The test stream is its own ("/eval/"), so the test set never depends on how much training drew.
    rng = random.Random(f"{seed}/{'eval' if split == 'test' else 'train'}/{task}")
    want_test = split == "test"
    items: list[Item] = []
    seen: set[str] = set()
    for _ in range(count * 200):  # bounded: small families may hold fewer than `count` problems
        problem = _FAMILIES[task](rng)
        if in_test_split(problem.key) != want_test or problem.key in seen:
            continue
        seen.add(problem.key)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        items.append(_item(task, problem, system))
        if len(items) == count:
            return items
    raise ValueError(f"{task}: could not draw {count} distinct {split} problems")


def held_out_set(count_per_task: int = 1000, seed: int = 0) -> dict[str, list[Item]]:
    """The held-out set: distinct problems per family, never seen in training."""
    return {task: generate(task, "test", count_per_task, seed) for task in TASKS}


# Share of the training mix per family, relative to the others' 1. Counting and reversal are learnt in the
# first 2,000 steps even at a quarter share, and json early, so their items are better spent on the families
# still learning when training stops: arithmetic above all (the first thing a newcomer asks) and sorting.
# The tool families' prompts are 4-5 times as long as the others' (the tools' JSON schemas), so a small
# share of them is a large share of the training tokens; they are learnt at this share all the same.
TRAINING_WEIGHTS = {
    "counting": 0.25, "reverse": 0.25, "json": 0.75, "addition": 2.5, "subtraction": 2.5, "sort": 1.25,
    "scope": 0.4, "tool": 0.3, "tool_result": 0.15, "multiturn": 0.5, "recall": 0.6,
}
# A quarter of the single-question training items come after one or two earlier exchanges, as in a chat: the
# answer must not change with them.
HISTORY_RATE = 0.25
_OWN_HISTORY = ("multiturn", "recall")


def training_stream(seed: int = 0, system_rate: float = 0.1) -> Iterator[Item]:
    """Endless, interleaved training items (repeats allowed: training draws with replacement)."""
    rng = random.Random(f"{seed}/mix")
    streams = {task: _train_stream(task, seed, system_rate) for task in TASKS}
    names = sorted(TASKS)
    weights = [TRAINING_WEIGHTS.get(name, 1.0) for name in names]
    while True:
        yield next(streams[rng.choices(names, weights)[0]])


def _train_stream(task: str, seed: int, system_rate: float) -> Iterator[Item]:
    rng = random.Random(f"{seed}/train/{task}")
    while True:
        problem = _FAMILIES[task](rng)
        if in_test_split(problem.key):
            continue
        if task not in _OWN_HISTORY and rng.random() < HISTORY_RATE:
            problem = with_history(rng, problem, rng.randint(1, 2))
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        yield _item(task, problem, system)


def adapter_training_stream(task: str, seed: int = 0) -> Iterator[Item]:
    """Endless training items of one adapter task, wording and earlier exchanges drawn as the base's are."""
    return _train_stream(task, seed, system_rate=0.1)


__all__ = ["ADAPTER_TASKS", "SCOPE_ANSWER", "SYSTEM_PROMPTS", "TASKS", "TEST_BUCKETS", "TOOLS", "TRAINING_WEIGHTS",
           "Item", "adapter_training_stream", "generate", "held_out_set", "in_test_split", "is_correct",
           "tool_call_text", "training_stream"]
