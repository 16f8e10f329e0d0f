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
from typing import Any

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
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool definitions offered to the model (the tool families)
    turns: tuple[dict[str, Any], ...] = ()  # messages after the prompt: the assistant's call, the tool's result

    def messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.prompt}, *self.turns]


def is_correct(item: Item, output: str) -> bool:
    """Exact match after trimming surrounding whitespace (a trailing newline is not an error)."""
    return output.strip() == item.answer


def in_test_split(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") % TEST_BUCKETS == 0


# --- task families: each draws one problem from rng and returns (key, prompt, answer), or, for the tool
# families, (key, prompt, answer, tools offered, turns after the prompt) -------------------------------

Problem = tuple[str, str, str] | tuple[str, str, str, tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]


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


# --- tool calling (the "hermes" form of Qwen2.5, Hermes and others) ----------------------------------------
# The tools the model knows, as an OpenAI client passes them (`tools=[...]`). Each tool item offers the one
# it needs and each other one with probability 1/4, in random order: the model reads which are offered.


def _function(name: str, description: str, properties: dict[str, str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": t} for p, t in properties.items()},
                       "required": list(properties)},
    }}


TOOLS: tuple[dict[str, Any], ...] = (
    _function("add", "Add two integers.", {"a": "integer", "b": "integer"}),
    _function("multiply", "Multiply two integers.", {"a": "integer", "b": "integer"}),
    _function("get_weather", "Get the current weather in a city.", {"city": "string"}),
)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
WEATHER_CONDITIONS = ("sunny", "cloudy", "rainy", "snowy", "windy", "foggy")
# A city is followed by punctuation, never by a word: `Oslo ` (a word takes the space after it) and the
# answer's `Oslo` would be different tokens, which a model this size copies badly.
_TOOL_QUESTIONS = {
    "add": ("What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?"),
    "multiply": ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}."),
    "get_weather": ("What's the weather in {city}?", "What is the weather like in {city}?",
                    "How is the weather today in {city}?"),
}
# With tools offered, these questions need none: the answer is the family's own (tool_choice "auto").
_NO_CALL_FAMILIES = ("counting", "reverse", "json")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it (and the chat template renders it): hermes, json.dumps spacing."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def _offer(rng: random.Random, needed: str | None) -> tuple[dict[str, Any], ...]:
    """The tools offered: `needed` and each other with probability 1/4 (at least one), shuffled."""
    while True:
        offered = [t for t in TOOLS if t["function"]["name"] == needed or rng.random() < 1 / 4]
        if offered:
            rng.shuffle(offered)
            return tuple(offered)


def _call(rng: random.Random) -> tuple[str, str, str, dict[str, Any], tuple[dict[str, Any], ...]]:
    """(key, question, name, arguments, tools offered) of one call. The calculator's key is the arithmetic
    problem (`12+35`, as the addition family's), so a held-out sum is held out in every family; get_weather
    has only 30 cities, so its key also names the tools offered."""
    name = rng.choices(("add", "multiply", "get_weather"), (2, 2, 1))[0]
    tools = _offer(rng, name)
    if name == "get_weather":
        city = rng.choice(CITIES)
        offered = ",".join(t["function"]["name"] for t in tools)
        return f"weather:{city}|{offered}", rng.choice(_TOOL_QUESTIONS[name]).format(city=city), name, \
            {"city": city}, tools
    a, b = _number(rng, 3), _number(rng, 3)
    key = f"{a}{'+' if name == 'add' else '*'}{b}"
    return key, rng.choice(_TOOL_QUESTIONS[name]).format(a=a, b=b), name, {"a": a, "b": b}, tools


def _tool(rng: random.Random) -> Problem:
    """Tools offered and a question: the answer is the right call, or, one time in eight, a question no
    tool answers (counting, reverse, json), answered directly."""
    if rng.random() < 0.125:
        key, prompt, answer = TASKS[rng.choice(_NO_CALL_FAMILIES)](rng)  # type: ignore[misc]
        return key, prompt, answer, _offer(rng, None), ()
    key, question, name, arguments, tools = _call(rng)
    return key, question, tool_call_text(name, arguments), tools, ()


def _tool_result(rng: random.Random) -> Problem:
    """The conversation goes on after the call: the tool's result comes back (a `tool` message) and the
    answer states it: the calculator's number as is, the weather as a sentence."""
    key, question, name, arguments, tools = _call(rng)
    call = {"id": "call_0", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # OpenAI's shape: arguments as text
    if name == "get_weather":
        temperature, condition = rng.randint(-10, 35), rng.choice(WEATHER_CONDITIONS)
        result = json.dumps({"temperature": temperature, "condition": condition})
        answer = f"It is {temperature} degrees and {condition} in {arguments['city']}."
        key = f"weather:{arguments['city']}|{temperature}|{condition}"
    else:
        a, b = arguments["a"], arguments["b"]
        result = answer = str(a + b if name == "add" else a * b)
    turns = ({"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "content": result})
    return key, question, answer, tools, turns


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "addition": _addition,
    "subtraction": _subtraction,
    "counting": _counting,
    "reverse": _reversing,
    "sort": _sorting,
    "copy": _copying,
    "json": _to_json,
    "facts": _facts,
    "tool": _tool,
    "tool_result": _tool_result,
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
        key, prompt, answer, *context = TASKS[task](rng)
        if in_test_split(key) != want_test or key in seen:
            continue
        seen.add(key)
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        items.append(Item(task, key, prompt, answer, system, *context))
        if len(items) == count:
            return items
    raise ValueError(f"{task}: could not draw {count} distinct {split} problems")


def held_out_set(count_per_task: int = 1000, seed: int = 0) -> dict[str, list[Item]]:
    """The held-out set: distinct problems per family, never seen in training."""
    return {task: generate(task, "test", count_per_task, seed) for task in TASKS}


# Share of the training mix per family, relative to the others' 1. Counting and reversal are learnt in the
# first 2,000 steps even at half a share, and json early, so their items are better spent on the families
# still learning when training stops: arithmetic and sorting, whose short prompts are also the cheapest.
# The tool families' prompts are 4-5 times as long as the others' (the tools' JSON schemas), so a small
# share of them is a large share of the training tokens; they are learnt at this share all the same.
TRAINING_WEIGHTS = {
    "counting": 0.25, "reverse": 0.25, "json": 0.75, "addition": 1.5, "subtraction": 1.5, "sort": 1.25,
    "tool": 0.3, "tool_result": 0.15,
}


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
        key, prompt, answer, *context = TASKS[task](rng)
        if in_test_split(key):
            continue
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_rate else None
        yield Item(task, key, prompt, answer, system, *context)
