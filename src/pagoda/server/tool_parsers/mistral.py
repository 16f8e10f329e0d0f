"""`mistral`: calls after the `[TOOL_CALLS]` marker, a special token in Mistral's tokenizers (so the text keeps
special tokens while it is read). Both forms Mistral's models write:
  older (Mistral 7B v0.3)    `[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, ...]` (or one object)
  newer (tokenizer v11 on)   `[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{...}`, `[ARGS]` optional,
                             a `[CALL_ID]id` after the name skipped
The text before the first marker is content; reading follows base.py's rule.
"""

from __future__ import annotations

import json
import re

from pagoda.server.tool_parsers.base import (
    CallsRead,
    ParsedOutput,
    Reading,
    after_list_item,
    assemble,
    held_back,
    skip_space,
)
from pagoda.wire.tool_calls import ToolCall, call_from_json

MARKER = "[TOOL_CALLS]"
ARGS_MARKER = "[ARGS]"
CALL_ID_MARKER = "[CALL_ID]"
_NAME = re.compile(r"[\w.\-]+")
_DECODER = json.JSONDecoder()


class MistralParser:
    reads_special_tokens = True

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(MARKER)
        if start < 0:
            return ParsedOutput(text if finished else text[: len(text) - held_back(text, MARKER)], [])
        return assemble(text, text[:start], _read_calls(text, start), finished, MARKER)


def _read_calls(text: str, position: int) -> CallsRead:
    """The calls from the marker at `position` on, each marker opening one call (newer form) or a list."""
    calls: list[ToolCall] = []
    while True:
        body = skip_space(text, position + len(MARKER))
        if body == len(text):
            return CallsRead(calls, Reading.WAITING, position)
        read = _read_listed(text, body, position) if text[body] in "[{" else _read_named(text, body, position)
        calls += read.calls
        if read.state is not Reading.COMPLETE:
            return CallsRead(calls, read.state, read.end)
        following = skip_space(text, read.end)
        if not text.startswith(MARKER, following):
            return CallsRead(calls, Reading.COMPLETE, read.end)
        position = following


def _read_named(text: str, body: int, marker: int) -> CallsRead:
    """`name[ARGS]{...}` at `body`: one call, or (not well formed, or unfinished) the text from its `marker`."""
    brace = text.find("{", body)
    if brace < 0:
        return CallsRead([], Reading.WAITING, marker)
    name = text[body:brace].partition(CALL_ID_MARKER)[0].removesuffix(ARGS_MARKER).strip()
    if not _NAME.fullmatch(name):
        return CallsRead([], Reading.MALFORMED, marker)
    try:
        arguments, end = _DECODER.raw_decode(text, brace)
    except json.JSONDecodeError:  # still being written (or never valid: then it is content at the end)
        return CallsRead([], Reading.WAITING, marker)
    if not isinstance(arguments, dict):
        return CallsRead([], Reading.MALFORMED, marker)
    return CallsRead([ToolCall(name, json.dumps(arguments, ensure_ascii=False))], Reading.COMPLETE, end)


def _read_listed(text: str, body: int, marker: int) -> CallsRead:
    """A JSON list of {"name", "arguments"} objects (or one object) at `body`. A bad or unfinished first item
    leaves the text from the `marker` on; a later one, the text from that item on."""
    if text[body] == "{":
        return _read_object(text, body, marker)
    calls: list[ToolCall] = []
    position = body + 1
    while True:
        item = skip_space(text, position)
        if item == len(text):
            return CallsRead(calls, Reading.WAITING, item if calls else marker)
        if text[item] == "]" and calls:
            return CallsRead(calls, Reading.COMPLETE, item + 1)
        read = _read_object(text, item, item if calls else marker)
        if read.state is not Reading.COMPLETE:
            return CallsRead(calls, read.state, read.end)
        calls += read.calls
        if isinstance(after := after_list_item(text, read.end, calls), CallsRead):
            return after
        position = after


def _read_object(text: str, start: int, resume: int) -> CallsRead:
    try:
        payload, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return CallsRead([], Reading.WAITING, resume)
    call = call_from_json(payload, "arguments")
    if call is None:
        return CallsRead([], Reading.MALFORMED, resume)
    return CallsRead([call], Reading.COMPLETE, end)
