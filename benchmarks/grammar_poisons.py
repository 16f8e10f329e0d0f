"""Grammar inputs for fuzz.py and soak.py: random output constraints, well-formed and hostile, as requests.

A constraint is a JSON schema, a regular expression, a choice list or a Lark grammar. Each family below makes
one sort of it from a `random.Random`; `grammar_case` puts one into a request through one of the fields a
client sends constraints in (`response_format`, vLLM's `structured_outputs`, vLLM's former `guided_*` fields,
or `tools` with a `tool_choice`), on /v1/completions or /v1/chat/completions. The same seed gives the same
requests. Hostile families aim at the grammar engine's worst cases (unbounded recursion, huge repeat counts,
exponential regexes, huge alternations, keywords of the wrong type); a server must answer each with a 4xx or
fail that request alone, never the other requests in the engine.

Standard library only, so that scripts running in their own environment (fuzz.py, with schemathesis) can
use it as well as those in pagoda's.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Repeat counts past every sensible bound: 2^32 - 1 (the regex that once failed every stream), 2^31 - 1,
# 2^53 (JSON's exact-integer limit), 2^63 and a number no machine integer holds.
HUGE_COUNTS = (4294967295, 2147483647, 1 << 32, 1 << 53, 1 << 63, 10**30, 1_000_000)
VALID_SHARE = 0.25  # of grammar_case's requests, those from the well-formed families
PROMPTS = ("Convert to JSON: pet=red, size=207", "What is 12 times 35?", "Reverse the list: red, tea, oslo",
           "Repeat exactly: k5ad boston 3qxofb", "Colour: ")
MAX_TOKENS = (1, 4, 8, 16)


def _word(rng: random.Random, length: int = 6) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, length)))


def _words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct words: three random letters each, then the index (one draw for all: lists run to 50,000)."""
    letters = [string.ascii_lowercase[byte % 26] for byte in rng.randbytes(3 * count)]
    return [f"{''.join(letters[3 * index:3 * index + 3])}{index}" for index in range(count)]


# --- JSON schemas ------------------------------------------------------------------------------------------


def valid_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small schema every output of which is short: bounded strings, numbers, arrays and objects."""
    kind = rng.choice(("string", "integer", "number", "boolean", "enum") + (("array", "object") * (depth < 2)))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "enum":
        return {"enum": _words(rng, rng.randint(1, 5))}
    if kind == "array":
        return {"type": "array", "items": valid_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "object":
        names = _words(rng, rng.randint(1, 3))
        return {"type": "object", "properties": {name: valid_schema(rng, depth + 1) for name in names},
                "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}
    return {"type": kind}


def deep_schema(rng: random.Random) -> dict[str, Any]:
    """Nesting 1 to 200 levels deep, through objects, arrays, anyOf or allOf (built inside out)."""
    schema: dict[str, Any] = {"type": "integer"}
    wrapper = rng.choice(("object", "array", "anyOf", "allOf", "mixed"))
    for _ in range(rng.randint(1, 200)):
        level = rng.choice(("object", "array", "anyOf", "allOf")) if wrapper == "mixed" else wrapper
        if level == "object":
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        elif level == "array":
            schema = {"type": "array", "items": schema, "minItems": 1}
        else:
            schema = {level: [schema]}
    return schema


def ref_to_root_schema(rng: random.Random) -> dict[str, Any]:
    """`$ref` to the whole schema: bare (no instance at all), or below a property, array or combinator."""
    return rng.choice((
        {"$ref": "#"},
        {"$ref": "#", "type": "object"},
        {"anyOf": [{"$ref": "#"}]},
        {"allOf": [{"$ref": "#"}, {"type": "string"}]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {"type": "object", "properties": {"self": {"$ref": "#"}}},
        {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    ))


def ref_loop_schema(rng: random.Random) -> dict[str, Any]:
    """Definitions that refer to each other in a cycle (a -> b -> a, or longer) with nothing in between."""
    names = _words(rng, rng.randint(2, 8))
    section = rng.choice(("$defs", "definitions"))
    definitions = {name: {"$ref": f"#/{section}/{names[(i + 1) % len(names)]}"} for i, name in enumerate(names)}
    if rng.random() < 0.3:  # one step of the loop passes through a combinator
        definitions[names[0]] = {"anyOf": [definitions[names[0]]]}
    return {section: definitions, "$ref": f"#/{section}/{names[0]}"}


def recursive_required_schema(rng: random.Random) -> dict[str, Any]:
    """A type that requires an instance of itself: no finite value is valid."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}, "value": {"type": "integer"}},
            "required": ["next"]}
    shape = rng.choice(("property", "array", "branches"))
    if shape == "array":
        node = {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 1}
    elif shape == "branches":
        node = {"anyOf": [{"type": "object", "properties": {"l": {"$ref": "#/$defs/node"}}, "required": ["l"]},
                          {"type": "array", "items": {"$ref": "#/$defs/node"}, "minItems": 2}]}
    return {"$defs": {"node": node}, "$ref": "#/$defs/node"}


def huge_bounds_schema(rng: random.Random) -> dict[str, Any]:
    """Sizes no output can reach, or contradictory ones: minItems, minLength, pattern repeats, ..."""
    count = rng.choice(HUGE_COUNTS)
    return rng.choice((
        {"type": "array", "items": {"type": "integer"}, "minItems": count},
        {"type": "array", "items": {"type": "string"}, "minItems": count, "maxItems": count},
        {"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2},
        {"type": "string", "minLength": count},
        {"type": "string", "minLength": count, "maxLength": count},
        {"type": "string", "pattern": f"^a{{{count}}}$"},
        {"type": "string", "pattern": "(ab{1000}){1000}"},
        {"type": "object", "minProperties": count},
        {"type": "integer", "minimum": count, "maximum": count * 2},
        {"type": "integer", "minimum": 10, "maximum": 1},
    ))


def big_choice_schema(rng: random.Random) -> dict[str, Any]:
    """A large enum, or anyOf / oneOf with hundreds to thousands of branches."""
    count = rng.choice((500, 2000, 10_000))
    combinator = rng.choice(("enum", "anyOf", "oneOf"))
    if combinator == "enum":
        return {"enum": _words(rng, count)}
    branches = [{"const": word} if i % 2 else {"type": "object", "properties": {word: {"type": "integer"}},
                                                 "required": [word]} for i, word in enumerate(_words(rng, count // 4))]
    return {combinator: branches}


def wrong_type_schema(rng: random.Random) -> Any:
    """Schema keywords holding values of the wrong type, unknown types, dangling or remote refs."""
    return rng.choice((
        {"type": 5}, {"type": "nonsense"}, {"type": ["string", 7]}, {"properties": []},
        {"type": "object", "properties": {"a": None}}, {"type": "object", "properties": {"a": 3}},
        {"required": "a"}, {"type": "object", "required": [1, 2]}, {"minLength": "3"}, {"maxItems": -1},
        {"minItems": 1.5}, {"enum": {}}, {"enum": []}, {"pattern": 7}, {"pattern": "("}, {"items": 3},
        {"anyOf": []}, {"anyOf": {}}, {"$ref": 5}, {"$ref": "#/nowhere"}, {"$ref": "http://127.0.0.1:1/x.json"},
        {"$defs": 3, "$ref": "#/$defs/a"}, {"const": {"a": [1, {"b": None}]}, "type": "string"},
        {"additionalProperties": "no"}, {"type": "string", "format": "nonsense"}, {"not": {}},
        {"if": {"type": "string"}, "then": 3}, {"": {}}, {"type": "object", "properties": {"": {"type": "x"}}},
        [], "a string", 42, None,
    ))


# --- regular expressions, choice lists, Lark grammars -----------------------------------------------------------


def valid_regex(rng: random.Random) -> str:
    return rng.choice((f"[a-z]{{1,{rng.randint(1, 12)}}}", f"({_word(rng)}|{_word(rng)})", r"\d{1,3}(,\d{3}){0,2}",
                       f"[A-Z][a-z]{{2,6}} [0-9]{{{rng.randint(1, 3)}}}", "(yes|no)"))


def huge_repeat_regex(rng: random.Random) -> str:
    count = rng.choice(HUGE_COUNTS)
    return rng.choice((f"x{{{count}}}", f"x{{0,{count}}}", f"x{{{count},}}", f"[a-z]{{{count}}}", f"(ab){{{count}}}",
                       f"(a{{{count}}}){{{count}}}", "(a{1000}){1000}", "[\\w\\W]{65536}"))


def nested_quantifier_regex(rng: random.Random) -> str:
    n = rng.randint(2, 200)
    return rng.choice(("(a+)+b", "((a*)*)*", "(a|aa)*c", "(x+x+)+y", f"((a{{1,{n}}}){{1,{n}}}){{1,{n}}}",
                       "(((a?){20}){20}){20}", "(" * n + "a*" + ")*" * n, "(.*a){30}"))


def huge_alternation_regex(rng: random.Random) -> str:
    words = _words(rng, rng.choice((1000, 5000, 20_000)))
    return "|".join(words) if rng.random() < 0.5 else "(" + ")|(".join(words) + ")"


def invalid_regex(rng: random.Random) -> Any:
    return rng.choice(("(", ")", "[z-a]", "a**", "(?P<", "\\", "*a", "(?<=a)b", "(a)\\1", "[[:nothing:]]",
                       "a{2,1}", "x{", "\\p{NoSuchClass}", "(?i", "[", "\ud800", "\x00(", "", 5, None, ["a"]))


def valid_choice(rng: random.Random) -> list[str]:
    return _words(rng, rng.randint(1, 8))


def empty_choice(rng: random.Random) -> list[str]:
    return []


def huge_choice(rng: random.Random) -> list[str]:
    if rng.random() < 0.3:
        return ["a" * rng.choice((10_000, 200_000)), "b"]
    return _words(rng, rng.choice((1000, 10_000, 50_000)))


def odd_type_choice(rng: random.Random) -> Any:
    return rng.choice(([1, 2], [None], [["a"]], [{"a": 1}], "yes", [""], ["a", 5], [True], {"a": "b"}, 42,
                       ["same", "same"], ["\x00"]))


def valid_lark(rng: random.Random) -> str:
    return rng.choice(('start: "yes" | "no"', 'start: WORD (" " WORD)*\nWORD: /[a-z]{1,8}/',
                       'start: num "+" num\nnum: /[0-9]{1,3}/', f'start: "{_word(rng)}" | "{_word(rng)}"'))


def _rule_chain(rules: int) -> str:
    """A grammar whose start symbol reaches a terminal only through `rules` rules, one after another."""
    return "start: r0" + "".join(f'\nr{i}: r{i + 1} | "x"' for i in range(rules)) + f'\nr{rules}: "y"'


def hostile_lark(rng: random.Random) -> Any:
    count, depth = rng.choice(HUGE_COUNTS), rng.randint(2, 200)
    makers: tuple[Callable[[], Any], ...] = (
        lambda: 'start: start "a" | "a"', lambda: "start: start", lambda: "start: a\na: b\nb: a",
        lambda: "start: undefined_rule", lambda: "start: (", lambda: 'foo: "a"', lambda: "",
        lambda: 'start: %json {"$ref": "#"}', lambda: 'start: %json {"type": "string", "minLength": 4294967295}',
        lambda: f"start: /x{{{count}}}/", lambda: f'start: "a"~{count}',
        lambda: "start: " + "(" * depth + '"a"' + ")" * depth, lambda: _rule_chain(rng.choice((100, 2000))),
        lambda: "start: /(a+)+b/", lambda: "%import common.NOTHING\nstart: NOTHING", lambda: 7, lambda: None,
    )
    return rng.choice(makers)()


# --- the families and their requests ------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    kind: str  # "json", "regex", "choice", "grammar": the constraint it makes, hence the fields it can go in
    hostile: bool
    make: Callable[[random.Random], Any]


FAMILIES: dict[str, Family] = {
    "schema_valid": Family("json", False, valid_schema),
    "schema_deep": Family("json", True, deep_schema),
    "schema_ref_root": Family("json", True, ref_to_root_schema),
    "schema_ref_loop": Family("json", True, ref_loop_schema),
    "schema_recursive_required": Family("json", True, recursive_required_schema),
    "schema_huge_bounds": Family("json", True, huge_bounds_schema),
    "schema_big_choice": Family("json", True, big_choice_schema),
    "schema_wrong_types": Family("json", True, wrong_type_schema),
    "regex_valid": Family("regex", False, valid_regex),
    "regex_huge_repeat": Family("regex", True, huge_repeat_regex),
    "regex_nested_quantifiers": Family("regex", True, nested_quantifier_regex),
    "regex_huge_alternation": Family("regex", True, huge_alternation_regex),
    "regex_invalid": Family("regex", True, invalid_regex),
    "choice_valid": Family("choice", False, valid_choice),
    "choice_empty": Family("choice", True, empty_choice),
    "choice_huge": Family("choice", True, huge_choice),
    "choice_odd_types": Family("choice", True, odd_type_choice),
    "lark_valid": Family("grammar", False, valid_lark),
    "lark_hostile": Family("grammar", True, hostile_lark),
}
VALID_FAMILIES = tuple(name for name, family in FAMILIES.items() if not family.hostile)
HOSTILE_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.hostile)
# Where each kind of constraint can be sent, with weights. `guided_*` are vLLM's former top-level fields.
CARRIERS: dict[str, tuple[tuple[str, int], ...]] = {
    "json": (("response_format", 3), ("structured_outputs", 3), ("tools", 3), ("guided", 1)),
    "regex": (("structured_outputs", 4), ("guided", 1)),
    "choice": (("structured_outputs", 4), ("guided", 1)),
    "grammar": (("structured_outputs", 4), ("guided", 1)),
}
TOOL_CHOICES = ("auto", "required", "none", "named")


@dataclass(frozen=True)
class GrammarCase:
    family: str
    hostile: bool
    carrier: str  # response_format | structured_outputs | guided | tools, then the tool_choice: "tools:auto"
    route: str
    body: dict[str, Any]


def _base_body(rng: random.Random, model: str, chat: bool) -> dict[str, Any]:
    prompt = rng.choice(PROMPTS)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice(MAX_TOKENS), "temperature": rng.choice((0.0, 1.0)),
                            "seed": rng.randrange(1 << 31), "stream": rng.random() < 0.5}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _tools(rng: random.Random, parameters: Any) -> tuple[list[dict[str, Any]], Any, str]:
    """One to three tools, the first with `parameters` as its schema, and a tool_choice of each sort."""
    tools = [{"type": "function", "function": {"name": "poison", "description": "Takes the fuzzed arguments.",
                                               "parameters": parameters}}]
    tools += [{"type": "function", "function": {"name": f"tool{i}", "parameters": valid_schema(rng)}}
              for i in range(rng.randint(0, 2))]
    rng.shuffle(tools)
    choice = rng.choice(TOOL_CHOICES)
    wire_choice = {"type": "function", "function": {"name": "poison"}} if choice == "named" else choice
    return tools, wire_choice, choice


def grammar_case(rng: random.Random, model: str, family: str | None = None) -> GrammarCase:
    """One request carrying a constraint of `family` (default: a well-formed family VALID_SHARE of the time,
    else a hostile one, each family equally likely within its group)."""
    if family is None:
        family = rng.choice(VALID_FAMILIES if rng.random() < VALID_SHARE else HOSTILE_FAMILIES)
    spec = FAMILIES[family]
    constraint = spec.make(rng)
    carriers, weights = zip(*CARRIERS[spec.kind])
    carrier = rng.choices(carriers, weights)[0]
    chat = carrier == "tools" or rng.random() < 0.5
    body = _base_body(rng, model, chat)
    if carrier == "tools":
        body["tools"], body["tool_choice"], choice = _tools(rng, constraint)
        carrier = f"tools:{choice}"
    elif carrier == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fuzzed", "schema": constraint}}
    elif carrier == "guided":
        body[f"guided_{spec.kind}"] = constraint
    else:
        as_text = spec.kind == "json" and rng.random() < 0.3  # vLLM also takes the schema as JSON text
        body["structured_outputs"] = {spec.kind: json.dumps(constraint) if as_text else constraint}
    route = "/v1/chat/completions" if chat else "/v1/completions"
    return GrammarCase(family, spec.hostile, carrier, route, body)
