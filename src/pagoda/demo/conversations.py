"""Conversations of several turns: earlier exchanges before the question, and questions about them.

A chat page or `pagoda chat` sends the whole conversation, so the model must answer the last question
whatever came before it (`multiturn`), and use an earlier turn where the question asks for it (`recall`:
facts the user said about themselves). Earlier exchanges are always drawn from the training split, in
either split: what is held out is the question asked last.
"""

from __future__ import annotations

import random
from typing import Any

from pagoda.demo.families import (
    Message,
    Problem,
    addition,
    copying,
    counting,
    facts,
    in_test_split,
    reversing,
    scope,
    sorting,
    subtraction,
    to_json,
)
from pagoda.demo.tool_tasks import tool_exchange
from pagoda.demo.vocabulary import ANIMALS, CITIES, COLORS, FOODS, NAMES, made_up_word

_EXCHANGE_FAMILIES = (addition, subtraction, counting, reversing, sorting, copying, to_json, facts, scope)
# What `multiturn` asks last: every question family the model answers reliably on its own, so the family
# measures what the history costs, not the difficulty of the question.
_LAST_QUESTIONS = (addition, subtraction, counting, reversing, sorting, copying, to_json, scope)


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def earlier_exchange(rng: random.Random, tools: tuple[dict[str, Any], ...]) -> tuple[Message, ...]:
    """One finished exchange from the training split: a question and its right answer, or, when tools are
    offered, one time in three a call of an offered tool, its result and the answer."""
    while True:
        if tools and rng.random() < 1 / 3:
            name = rng.choice([t["function"]["name"] for t in tools])
            key, question, turns, answer = tool_exchange(rng, name, tools)
            messages: tuple[Message, ...] = (_user(question), *turns, _assistant(answer))
        else:
            problem = rng.choice(_EXCHANGE_FAMILIES)(rng)
            key, messages = problem.key, (_user(problem.prompt), _assistant(problem.answer))
        if not in_test_split(key):
            return messages


def with_history(rng: random.Random, problem: Problem, exchanges: int) -> Problem:
    history = tuple(m for _ in range(exchanges) for m in earlier_exchange(rng, problem.tools))
    return Problem(problem.key, problem.prompt, problem.answer, problem.tools, problem.turns, history)


def multiturn(rng: random.Random) -> Problem:
    """2-4 earlier exchanges of any family, then a question answered by itself alone."""
    last = rng.choice(_LAST_QUESTIONS)(rng)
    return with_history(rng, last, rng.randint(2, 4))


def _any_name(rng: random.Random) -> str:
    return made_up_word(rng).capitalize() if rng.random() < 0.25 else rng.choice(NAMES)


# relation: (draw a value, what the user says, the model's acknowledgement, questions about it)
USER_FACTS = {
    "name": (_any_name, "My name is {v}.", "Nice to meet you, {v}.", ("What is my name?", "What's my name?")),
    "city": (lambda rng: rng.choice(CITIES), "I live in {v}.", "Got it.", ("Where do I live?",
                                                                            "Which city do I live in?")),
    "pet": (lambda rng: rng.choice(ANIMALS), "I have a {v}.", "Got it.", ("What pet do I have?",
                                                                          "What animal do I have?")),
    "color": (lambda rng: rng.choice(COLORS), "My favorite color is {v}.", "Got it.",
              ("What is my favorite color?",)),
    "food": (lambda rng: rng.choice(FOODS), "I like {v}.", "Got it.", ("What do I like?", "What food do I like?")),
}


def recall(rng: random.Random) -> Problem:
    """The user tells 1-2 facts about themselves among 0-3 other exchanges, then asks for one of them; or,
    one time in five, tells a fact last, and the answer acknowledges it."""
    told = {relation: USER_FACTS[relation][0](rng) for relation in rng.sample(sorted(USER_FACTS), rng.randint(1, 2))}
    exchanges = [earlier_exchange(rng, ()) for _ in range(rng.randint(0, 3))]
    statements = [(_user(USER_FACTS[r][1].format(v=v)), _assistant(USER_FACTS[r][2].format(v=v)))
                  for r, v in told.items()]
    facts_key = "|".join(f"{r}={v}" for r, v in told.items())
    if rng.random() < 0.2:
        last_said, acknowledgement = statements.pop()
        key, prompt, answer = f"recall-ack:{facts_key}", last_said["content"], acknowledgement["content"]
    else:
        asked = rng.choice(sorted(told))
        key, prompt, answer = f"recall:{facts_key}|{asked}", rng.choice(USER_FACTS[asked][3]), told[asked]
    for statement in statements:  # each at a random place among the other exchanges
        exchanges.insert(rng.randint(0, len(exchanges)), statement)
    return Problem(key, prompt, answer, history=tuple(m for exchange in exchanges for m in exchange))
