"""Rule bounds on a constraint, checked before the grammar engine sees it (GrammarLimits' pagoda fields).

Each names the limit it enforces and the flag that sets it. What they stop, measured on llguidance 1.9:
a regex repeat `x{4294967295}` (or `(x{1000}){1000}`) compiles, then fails its first token ("too many
expressions constructed"); a JSON schema nested 64 properties deep (128 JSON levels) fails to compile with
an exception rather than an error; a long enum or choice list costs compile time in proportion. Schema
counts (`minItems`, `maxLength`, ...) do not blow llguidance up (it counts lazily), but a minimum past
`max_repeat` asks for an output no context holds, so minimums are bounded and maximums are not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagoda.structured.limits import GrammarLimits, grammar_flag
from pagoda.structured.params import StructuredOutputsParams
from pagoda.structured.schema_rules import recursion_problem

_MINIMUM_COUNTS = ("minItems", "minLength", "minProperties", "minContains")
_ALTERNATIVES = ("enum", "anyOf", "oneOf")
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_LARK_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_LARK_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACED_ESCAPES = "xupPN"  # \x{41}, \u{41}, \p{Greek}, ...: braces that are not a repeat


def bounds_problem(params: StructuredOutputsParams, limits: GrammarLimits) -> str | None:
    """Why `params` is past a rule bound (a message naming the limit and its flag), or None."""
    kind = params.kind
    if kind == "json":
        return _schema_problem(json.loads(params.canonical_text), limits)
    if kind == "regex":
        return _repeat_problem(_regex_repeat(params.canonical_text), "the regex", limits)
    if kind == "choice":
        count = len(params.choice or ())
        if count > limits.max_alternatives:
            return _past(f"the choice list has {count} choices", "max_alternatives", limits)
    if kind == "grammar":
        text = _LARK_STRING.sub('""', params.canonical_text)
        repeats = [int(high or low) for low, high in _LARK_REPEAT.findall(text)]
        return _repeat_problem(max([_regex_repeat(text), *repeats]), "the grammar", limits)
    return None


def _past(found: str, name: str, limits: GrammarLimits) -> str:
    return f"{found}; the server allows at most {getattr(limits, name)} ({name}, {grammar_flag(name)})"


def _repeat_problem(count: int, what: str, limits: GrammarLimits) -> str | None:
    if count > limits.max_repeat:
        return _past(f"{what} repeats a part {count} times (nested counts multiplied)", "max_repeat", limits)
    return None


def _schema_problem(schema: Any, limits: GrammarLimits) -> str | None:
    """Depth, counts, alternatives and patterns in one pass over the document (iterative: no recursion
    limit of Python's to reach), then the recursion rules."""
    pending: list[tuple[Any, int]] = [(schema, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > limits.max_schema_depth:
            return _past(f"the JSON schema nests objects and arrays {depth} levels deep", "max_schema_depth", limits)
        if isinstance(value, list):
            pending += [(item, depth + 1) for item in value]
        elif isinstance(value, dict):
            problem = _keyword_problem(value, limits)
            if problem is not None:
                return problem
            pending += [(item, depth + 1) for item in value.values()]
    return recursion_problem(schema)


def _keyword_problem(node: dict[str, Any], limits: GrammarLimits) -> str | None:
    for key in _MINIMUM_COUNTS:
        count = node.get(key)
        if isinstance(count, (int, float)) and not isinstance(count, bool) and count > limits.max_repeat:
            return _past(f"the JSON schema's {key} is {int(count)}", "max_repeat", limits)
    for key in _ALTERNATIVES:
        members = node.get(key)
        if isinstance(members, list) and len(members) > limits.max_alternatives:
            return _past(f"the JSON schema's {key} has {len(members)} alternatives", "max_alternatives", limits)
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        problem = _repeat_problem(_regex_repeat(pattern), "the JSON schema's pattern", limits)
        if problem is not None:
            return problem
    return None


def _regex_repeat(pattern: str) -> int:
    """The largest repeat count in a regex (Rust syntax), counts of nested groups multiplied: `(x{10}){5}`
    is 50. `*`, `+` and `?` repeat lazily in llguidance and count as 1; so do escapes and character classes."""
    frames = [1]  # per open group: the largest count inside it so far
    last = 1  # the count of the atom just read, which a quantifier multiplies
    largest, index = 1, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            braced = pattern[index + 1 : index + 2] in tuple(_BRACED_ESCAPES) and pattern[index + 2 : index + 3] == "{"
            end = pattern.find("}", index) if braced else -1
            index, last = (end + 1 if end >= 0 else index + 2), 1
        elif char == "[":
            index, last = _class_end(pattern, index), 1
        elif char == "(":
            frames.append(1)
            index, last = index + 1, 1
        elif char == ")":
            last = frames.pop() if len(frames) > 1 else 1
            frames[-1] = max(frames[-1], last)
            index += 1
        elif char == "{" and (match := _QUANTIFIER.match(pattern, index)):
            low, high = match.group(1), match.group(2)
            last *= max(int(low), int(high) if high else 0)
            frames[-1] = max(frames[-1], last)
            largest = max(largest, last)
            index = match.end()
        else:
            index, last = index + 1, 1
    return max(largest, *frames)


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at `start` (nested classes and escapes skipped)."""
    depth, index = 0, start
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        index += 1
        if char == "[":
            depth += 1
            index += pattern[index : index + 1] == "^"
            index += pattern[index : index + 1] == "]"  # a leading ] is a literal
        elif char == "]":
            depth -= 1
            if depth == 0:
                return index
    return len(pattern)
