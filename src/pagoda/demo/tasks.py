"""Synthetic, checkable tasks for the demo model: generators, the train/test split, exact-match scoring.

Pure Python (no torch), deterministic from a seed. Every item carries a canonical `key` naming the problem
(not its wording); the split is a hash of that key, so a held-out problem never reaches training under
any phrasing, and the two splits need not be generated together to stay disjoint.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TEST_BUCKETS = 8  # 1 key in 8 is held out for testing
SYSTEM_PROMPTS = (
    "You are pagoda-demo, a tiny model that solves small, checkable tasks.",
    "Answer with the result only.",
    "You are a helpful assistant.",
)

NAMES = (
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Karl", "Liam",
    "Mia", "Nina", "Omar", "Paul", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor", "Wendy", "Xavier",
    "Yara", "Zoe", "Anna", "Ben", "Chloe", "Dan", "Eva", "Felix", "Gina", "Hugo", "Iris", "Jack", "Kate",
    "Leo", "Maya", "Noah",
)
CITIES = (
    "Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Berlin", "Madrid", "Vienna", "Prague",
    "Dublin", "Lisbon", "Athens", "Seoul", "Quito", "Nairobi", "Sydney", "Boston", "Denver", "Toronto",
    "Havana", "Dakar", "Hanoi", "Kyiv", "Riga", "Bern", "Sofia", "Tunis", "Perth",
)
FOODS = (
    "apples", "bread", "cheese", "rice", "soup", "pasta", "pizza", "salad", "tea", "coffee", "honey",
    "figs", "plums", "grapes", "nuts", "tacos",
)
ANIMALS = (
    "cat", "dog", "fish", "bird", "horse", "rabbit", "turtle", "hamster", "parrot", "snake", "frog", "goat",
    "duck", "mouse", "lizard", "pony",
)
COLORS = (
    "red", "blue", "green", "yellow", "black", "white", "orange", "purple", "pink", "brown", "gray", "gold",
)
WORDS = tuple(dict.fromkeys(w.lower() for w in (*FOODS, *ANIMALS, *COLORS, *CITIES)))
JSON_KEYS = (
    "name", "age", "city", "color", "pet", "id", "score", "size", "level", "count", "food", "mode",
)


@dataclass(frozen=True)
class Item:
    task: str
    key: str  # canonical problem, independent of wording: decides the split
    prompt: str
    answer: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.prompt}]


def is_correct(item: Item, output: str) -> bool:
    """Exact match after trimming surrounding whitespace (a trailing newline is not an error)."""
    return output.strip() == item.answer


def in_test_split(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") % TEST_BUCKETS == 0


# --- task families: each draws one problem from rng and returns (key, prompt, answer) -----------------

Problem = tuple[str, str, str]


def _number(rng: random.Random, max_digits: int) -> int:
    # Draw the digit count first, so short and long operands are equally common.
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _addition(rng: random.Random) -> Problem:
    a, b = _number(rng, 3), _number(rng, 3)
    prompt = rng.choice(("What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} ="))
    return f"{a}+{b}", prompt.format(a=a, b=b), str(a + b)


def _subtraction(rng: random.Random) -> Problem:
    a, b = _number(rng, 3), _number(rng, 3)
    a, b = max(a, b), min(a, b)  # non-negative results only
    prompt = rng.choice(("What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} ="))
    return f"{a}-{b}", prompt.format(a=a, b=b), str(a - b)


def _counting(rng: random.Random) -> Problem:
    items = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
    text = ", ".join(items)
    prompt = rng.choice(("How many items are in this list: {x}?", "Count the items: {x}"))
    return "count:" + text, prompt.format(x=text), str(len(items))


def _reversing(rng: random.Random) -> Problem:
    items = rng.sample(WORDS, rng.randint(2, 5))
    text = ", ".join(items)
    prompt = rng.choice(("Reverse the list: {x}", "Reverse this list: {x}"))
    return "reverse:" + text, prompt.format(x=text), ", ".join(reversed(items))


def _sorting(rng: random.Random) -> Problem:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 5))]
    text = ", ".join(map(str, numbers))
    prompt = rng.choice(("Sort the numbers: {x}", "Sort these numbers in ascending order: {x}"))
    return "sort:" + text, prompt.format(x=text), ", ".join(map(str, sorted(numbers)))


def _code(rng: random.Random) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 6)))


def _copying(rng: random.Random) -> Problem:
    parts = [rng.choice(WORDS) if rng.random() < 0.6 else _code(rng) for _ in range(rng.randint(1, 4))]
    text = " ".join(parts)
    prompt = rng.choice(("Repeat exactly: {x}", "Copy this text: {x}"))
    return "copy:" + text, prompt.format(x=text), text


def _json_value(rng: random.Random) -> str | int:
    return rng.randint(0, 999) if rng.random() < 0.4 else rng.choice(WORDS)


def _to_json(rng: random.Random) -> Problem:
    pairs = {key: _json_value(rng) for key in rng.sample(JSON_KEYS, rng.randint(1, 3))}
    text = ", ".join(f"{k}={v}" for k, v in pairs.items())
    prompt = rng.choice(("Convert to JSON: {x}", "Write as a JSON object: {x}"))
    return "json:" + text, prompt.format(x=text), json.dumps(pairs)


# (statement, question) per relation: facts about people stated in the prompt, then one question.
RELATIONS = {
    "city": (CITIES, "{n} lives in {v}.", ("Where does {n} live?", "Which city does {n} live in?")),
    "food": (FOODS, "{n} likes {v}.", ("What does {n} like?",)),
    "pet": (ANIMALS, "{n} has a {v}.", ("What pet does {n} have?", "What animal does {n} have?")),
    "color": (COLORS, "{n}'s favorite color is {v}.", ("What is {n}'s favorite color?",)),
}


def _facts(rng: random.Random) -> Problem:
    values, statement, questions = RELATIONS[rng.choice(sorted(RELATIONS))]
    people = rng.sample(NAMES, rng.randint(2, 4))
    answers = {name: rng.choice(values) for name in people}
    target = rng.choice(people)
    text = " ".join(statement.format(n=name, v=value) for name, value in answers.items())
    question = rng.choice(questions).format(n=target)
    return f"facts:{text}|{target}", f"{text} {question}", answers[target]


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "addition": _addition,
    "subtraction": _subtraction,
    "counting": _counting,
    "reverse": _reversing,
    "sort": _sorting,
    "copy": _copying,
    "json": _to_json,
    "facts": _facts,
}


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
        key, prompt, answer = TASKS[task](rng)
        if in_test_split(key) != want_test or key in seen:
            continue
        seen.add(key)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        items.append(Item(task, key, prompt, answer, system))
        if len(items) == count:
            return items
    raise ValueError(f"{task}: could not draw {count} distinct {split} problems")


def held_out_set(count_per_task: int = 1000, seed: int = 0) -> dict[str, list[Item]]:
    """The held-out set: distinct problems per family, never seen in training."""
    return {task: generate(task, "test", count_per_task, seed) for task in TASKS}


# Share of the training mix per family, relative to the others' 1: counting and reversal are learnt in the
# first 2,000 steps, so their items are better spent on the families that need copying and recall.
TRAINING_WEIGHTS = {"counting": 0.5, "reverse": 0.5}


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
        key, prompt, answer = TASKS[task](rng)
        if in_test_split(key):
            continue
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        yield Item(task, key, prompt, answer, system)
