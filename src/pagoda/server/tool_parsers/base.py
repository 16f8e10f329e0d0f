"""What every tool-call parser shares: its output, its protocol, and the reading rule of the formats whose calls
follow one another (`mistral`, `pythonic`).

A parser is stateless: it reads the whole text so far each time the text grows, so one instance serves every
choice of a request. Its answer must only grow as the text does (a stream sends the difference): content only
gains characters at its end, calls are only appended. That is why, in those formats, reading stops at the first
thing that is not a well-formed call: the calls before it stand (a stream has sent them already), and the text
from there on is content. A first call that is not well formed leaves the whole output as content.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Protocol

from pagoda.wire.tool_calls import ToolCall, call_from_json


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # text that is not a tool call
    tool_calls: list[ToolCall]


class ToolCallParser(Protocol):
    # The call marker is a special token in the models that use this format: the text must keep it.
    reads_special_tokens: bool

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        """The calls complete in `text` so far, and the content that is surely not part of a call (while
        not finished, a tail that may begin a call is held back)."""
        ...


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def decode_call(body: str, arguments_key: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body), arguments_key)
    except json.JSONDecodeError:
        return None


class Reading(enum.Enum):
    COMPLETE = "complete"  # the calls end at `end`; what follows is not a call
    WAITING = "waiting"  # a call is being written from `end`
    MALFORMED = "malformed"  # the text from `end` is not a well-formed call


@dataclass(frozen=True)
class CallsRead:
    calls: list[ToolCall]
    state: Reading
    end: int


def after_list_item(text: str, end: int, calls: list[ToolCall]) -> CallsRead | int:
    """After one call of a `[...]` list ends at `end`: the position past its comma, where the next call starts,
    or how the list reads when it goes no further (waiting, complete at `]`, malformed)."""
    position = skip_space(text, end)
    if position == len(text):
        return CallsRead(calls, Reading.WAITING, position)
    if text[position] == "]":
        return CallsRead(calls, Reading.COMPLETE, position + 1)
    if text[position] != ",":
        return CallsRead(calls, Reading.MALFORMED, position)
    return position + 1


def assemble(text: str, content_before: str, read: CallsRead, finished: bool, marker: str | None) -> ParsedOutput:
    """The parse of a text whose calls were read as `read`, after `content_before`: the rule of the module
    docstring. A call still being written when the output ends (cut by max_tokens) is content, as written."""
    if read.state is Reading.WAITING and not finished:
        return ParsedOutput(content_before, read.calls)
    if read.state is not Reading.COMPLETE:
        return ParsedOutput(content_before + text[read.end :], read.calls)
    rest = text[read.end :].lstrip()
    if not finished and marker is not None:
        rest = rest[: len(rest) - held_back(rest, marker)]
    return ParsedOutput(content_before + rest, read.calls)
