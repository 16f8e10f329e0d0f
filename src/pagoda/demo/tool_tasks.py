"""The tool-calling families of the demo model, in the "hermes" form (Qwen2.5's, Hermes's).

The model knows three tools (`TOOLS`, as an OpenAI client passes them). A tool item offers the one it
needs and each other one with probability 1/4, in random order: the model reads which are offered.
"""

from __future__ import annotations

import json
import random
from typing import Any

from pagoda.demo.families import Message, Problem, counting, number, reversing, to_json
from pagoda.demo.vocabulary import CITIES


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
_NO_CALL_FAMILIES = (counting, reversing, to_json)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the model writes it (and the chat template renders it): hermes, json.dumps spacing."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def offer(rng: random.Random, needed: str | None) -> tuple[dict[str, Any], ...]:
    """The tools offered: `needed` and each other with probability 1/4 (at least one), shuffled."""
    while True:
        offered = [t for t in TOOLS if t["function"]["name"] == needed or rng.random() < 1 / 4]
        if offered:
            rng.shuffle(offered)
            return tuple(offered)


def _call(rng: random.Random, name: str, tools: tuple[dict[str, Any], ...]) -> tuple[str, str, dict[str, Any]]:
    """(key, question, arguments) of one call. The calculator's key is the arithmetic problem (`12+35`, as
    the addition family's), so a held-out sum is held out in every family; get_weather has only a few dozen
    cities, so its key also names the tools offered."""
    if name == "get_weather":
        city = rng.choice(CITIES)
        offered = ",".join(t["function"]["name"] for t in tools)
        return f"weather:{city}|{offered}", rng.choice(_TOOL_QUESTIONS[name]).format(city=city), {"city": city}
    a, b = number(rng, 3), number(rng, 3)
    key = f"{a}{'+' if name == 'add' else '*'}{b}"
    return key, rng.choice(_TOOL_QUESTIONS[name]).format(a=a, b=b), {"a": a, "b": b}


def tool(rng: random.Random) -> Problem:
    """Tools offered and a question: the answer is the right call, or, one time in eight, a question no
    tool answers (counting, reverse, json), answered directly."""
    if rng.random() < 0.125:
        direct = rng.choice(_NO_CALL_FAMILIES)(rng)
        return Problem(direct.key, direct.prompt, direct.answer, offer(rng, None))
    name = rng.choices(("add", "multiply", "get_weather"), (2, 2, 1))[0]
    tools = offer(rng, name)
    key, question, arguments = _call(rng, name, tools)
    return Problem(key, question, tool_call_text(name, arguments), tools)


def tool_exchange(rng: random.Random, name: str, tools: tuple[dict[str, Any], ...]) -> tuple[str, str, tuple[
        Message, ...], str]:
    """(key, question, the call and the tool's result as messages, the answer) of one call of `name`."""
    key, question, arguments = _call(rng, name, tools)
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
    return key, question, turns, answer


def tool_result(rng: random.Random) -> Problem:
    """The conversation goes on after the call: the tool's result comes back (a `tool` message) and the
    answer states it: the calculator's number as is, the weather as a sentence."""
    name = rng.choices(("add", "multiply", "get_weather"), (2, 2, 1))[0]
    tools = offer(rng, name)
    key, question, turns, answer = tool_exchange(rng, name, tools)
    return Problem(key, question, answer, tools, turns)
