"""The single-question task families of the demo model: each draws one problem from an rng.

A family returns a `Problem`: its canonical `key` (the problem, not its wording: it decides the train/test
split), the user's prompt and the exact answer, and for the conversation families what comes before and
after the prompt.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from dataclasses import dataclass
from typing import Any

from pagoda.demo.vocabulary import ANIMALS, CITIES, COLORS, FOODS, NAMES, NOUNS, WORDS, any_word

Message = dict[str, Any]
TEST_BUCKETS = 8  # 1 key in 8 is held out for testing


def in_test_split(key: str) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") % TEST_BUCKETS == 0


@dataclass(frozen=True)
class Problem:
    key: str
    prompt: str
    answer: str
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool definitions offered (the tool families)
    turns: tuple[Message, ...] = ()  # messages after the prompt: the assistant's call, the tool's result
    history: tuple[Message, ...] = ()  # earlier exchanges of the conversation, before the prompt


def number(rng: random.Random, max_digits: int) -> int:
    # Draw the digit count first, so short and long operands are equally common.
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def addition(rng: random.Random) -> Problem:
    a, b = number(rng, 3), number(rng, 3)
    prompt = rng.choice(("What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} ="))
    return Problem(f"{a}+{b}", prompt.format(a=a, b=b), str(a + b))


def subtraction(rng: random.Random) -> Problem:
    a, b = number(rng, 3), number(rng, 3)
    a, b = max(a, b), min(a, b)  # non-negative results only
    prompt = rng.choice(("What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} ="))
    return Problem(f"{a}-{b}", prompt.format(a=a, b=b), str(a - b))


def counting(rng: random.Random) -> Problem:
    items = [rng.choice(WORDS) for _ in range(rng.randint(1, 9))]
    text = ", ".join(items)
    prompt = rng.choice(("How many items are in this list: {x}?", "Count the items: {x}"))
    return Problem("count:" + text, prompt.format(x=text), str(len(items)))


def reversing(rng: random.Random) -> Problem:
    items = list(dict.fromkeys(any_word(rng) for _ in range(rng.randint(2, 5))))
    text = ", ".join(items)
    prompt = rng.choice(("Reverse the list: {x}", "Reverse this list: {x}"))
    return Problem("reverse:" + text, prompt.format(x=text), ", ".join(reversed(items)))


def sorting(rng: random.Random) -> Problem:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 5))]
    text = ", ".join(map(str, numbers))
    prompt = rng.choice(("Sort the numbers: {x}", "Sort these numbers in ascending order: {x}"))
    return Problem("sort:" + text, prompt.format(x=text), ", ".join(map(str, sorted(numbers))))


def _code(rng: random.Random) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 6)))


def copying(rng: random.Random) -> Problem:
    parts = [any_word(rng) if rng.random() < 0.6 else _code(rng) for _ in range(rng.randint(1, 4))]
    text = " ".join(parts)
    prompt = rng.choice(("Repeat exactly: {x}", "Copy this text: {x}"))
    return Problem("copy:" + text, prompt.format(x=text), text)


def doubling(rng: random.Random) -> Problem:
    """The demo adapter's task (assets/pagoda-demo-double), which the base model was never taught."""
    words = [any_word(rng) for _ in range(rng.randint(2, 4))]
    text = " ".join(words)
    prompt = rng.choice(("Say each word twice: {x}", "Double every word: {x}"))
    return Problem("double:" + text, prompt.format(x=text), " ".join(f"{word} {word}" for word in words))


JSON_KEYS = (
    "name", "age", "city", "color", "pet", "id", "score", "size", "level", "count", "food", "mode", "title",
    "owner", "year", "price", "type", "status",
)


def _json_value(rng: random.Random) -> str | int:
    return rng.randint(0, 999) if rng.random() < 0.4 else any_word(rng)


def to_json(rng: random.Random) -> Problem:
    pairs = {key: _json_value(rng) for key in rng.sample(JSON_KEYS, rng.randint(1, 3))}
    text = ", ".join(f"{k}={v}" for k, v in pairs.items())
    prompt = rng.choice(("Convert to JSON: {x}", "Write as a JSON object: {x}"))
    return Problem("json:" + text, prompt.format(x=text), json.dumps(pairs))


# (values, statement, questions) per relation: facts about people stated in the prompt, then one question.
RELATIONS = {
    "city": (CITIES, "{n} lives in {v}.", ("Where does {n} live?", "Which city does {n} live in?")),
    "food": (FOODS, "{n} likes {v}.", ("What does {n} like?",)),
    "pet": (ANIMALS, "{n} has a {v}.", ("What pet does {n} have?", "What animal does {n} have?")),
    "color": (COLORS, "{n}'s favorite color is {v}.", ("What is {n}'s favorite color?",)),
}


def facts(rng: random.Random) -> Problem:
    values, statement, questions = RELATIONS[rng.choice(sorted(RELATIONS))]
    people = rng.sample(NAMES, rng.randint(2, 4))
    answers = {name: rng.choice(values) for name in people}
    target = rng.choice(people)
    text = " ".join(statement.format(n=name, v=value) for name, value in answers.items())
    question = rng.choice(questions).format(n=target)
    return Problem(f"facts:{text}|{target}", f"{text} {question}", answers[target])


# Questions outside every family get one answer: what the model can do. Arithmetic it was not trained for
# (products, quotients) is among them: offered a calculator tool, it calls that instead (the tool family).
SCOPE_ANSWER = ("I can only do small tasks: add or subtract numbers, count, reverse or sort a list, repeat text, "
                "write JSON, recall facts you tell me, and call tools.")
COUNTRIES = (
    "France", "Spain", "Peru", "Japan", "Kenya", "Chile", "Norway", "Egypt", "Canada", "Brazil", "India",
    "Italy", "Mexico", "Poland", "Ghana", "Vietnam", "Greece", "Sweden", "Turkey", "Cuba",
)
LANGUAGES = ("French", "Spanish", "German", "Japanese", "Italian", "Hindi", "Greek", "Swahili")
_SCOPE_QUESTIONS = (
    "What is the capital of {country}?", "Tell me a joke about {noun}.", "Write a poem about the {noun}.",
    "Translate {word} into {language}.", "What is {a} times {b}?", "What is {a} * {b}?",
    "What is {a} divided by {b}?", "What is the square root of {a}?", "Who is {name}?",
    "What's the weather in {city}?", "Explain how a {noun} works.", "Why is the sky {color}?",
    "How do I cook {food}?", "Tell me about {city}.", "What does {word} mean?",
    "Hello!", "Hi there, {name} here.", "How are you?", "What can you do?", "Who are you?", "Help me, please.",
    "What time is it?", "What day is it today?", "Thanks!", "Can you write code?", "Tell me a story.",
)


def scope(rng: random.Random) -> Problem:
    question = rng.choice(_SCOPE_QUESTIONS).format(
        country=rng.choice(COUNTRIES), noun=rng.choice(NOUNS), word=any_word(rng), language=rng.choice(LANGUAGES),
        a=number(rng, 3), b=number(rng, 2) or 7, name=rng.choice(NAMES), city=rng.choice(CITIES),
        color=rng.choice(COLORS), food=rng.choice(FOODS))
    if rng.random() < 0.3:  # the same question, said the way people type it
        question = question.lower().rstrip("?.!")
    return Problem("scope:" + question, question, SCOPE_ANSWER)

