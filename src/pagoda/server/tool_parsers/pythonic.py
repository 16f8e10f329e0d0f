"""`pythonic`: the output is a Python list of calls with keyword arguments, `[get_weather(city="Oslo"), add(a=1,
b=2)]` (Llama 3.2, Llama 4 and others). Read with `ast` (arguments must be literals: strings, numbers, booleans,
None, lists and dicts of them), never evaluated. An output that does not start with `[` is content; reading
follows base.py's rule, and text after the list is content.
"""

from __future__ import annotations

import ast
import json
import re

from pagoda.server.tool_parsers.base import CallsRead, ParsedOutput, Reading, after_list_item, assemble, skip_space
from pagoda.wire.tool_calls import ToolCall

_FUNCTION_NAME = re.compile(r"[A-Za-z_]\w*")
_NOT_WELL_FORMED = -1


class PythonicParser:
    reads_special_tokens = False

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = skip_space(text, 0)
        if start == len(text):
            return ParsedOutput(text if finished else "", [])
        if text[start] != "[":
            return ParsedOutput(text, [])
        return assemble(text, "", _read_list(text, start), finished, None)


def _read_list(text: str, start: int) -> CallsRead:
    calls: list[ToolCall] = []
    position = start + 1
    while True:
        item = skip_space(text, position)
        resume = item if calls else 0  # a first call that is not well formed: the whole output is content
        if item == len(text):
            return CallsRead(calls, Reading.WAITING, resume)
        if text[item] == "]":
            return CallsRead(calls, Reading.COMPLETE, item + 1) if calls else CallsRead([], Reading.MALFORMED, 0)
        end = _call_end(text, item)
        if end is None:
            return CallsRead(calls, Reading.WAITING, resume)
        call = _to_call(text[item:end]) if end != _NOT_WELL_FORMED else None
        if call is None:
            return CallsRead(calls, Reading.MALFORMED, resume)
        calls.append(call)
        if isinstance(after := after_list_item(text, end, calls), CallsRead):
            return after
        position = after


def _call_end(text: str, start: int) -> int | None:
    """Where the call `name(...)` at `start` ends: past its closing parenthesis, found by counting brackets
    outside string literals; None while it is unfinished, _NOT_WELL_FORMED if it cannot be a call."""
    name = _FUNCTION_NAME.match(text, start)
    if name is None:
        return _NOT_WELL_FORMED
    position = name.end()
    if position == len(text):
        return None
    if text[position] != "(":
        return _NOT_WELL_FORMED
    depth, quote = 0, ""
    while position < len(text):
        char = text[position]
        if quote:
            if char == "\\":
                position += 1  # the escaped character, whatever it is
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None


def _to_call(source: str) -> ToolCall | None:
    """`name(key=literal, ...)` as a call with its arguments as a JSON object; None for anything else."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **mapping
                return None
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
