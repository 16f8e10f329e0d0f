"""Tool calling: the model's own tool-call text parsed into OpenAI's `tool_calls`, and forced calls.

`tool_choice: "auto"` lets the model decide; its output is parsed by the parser named with
`--tool-call-parser` (the format its chat template teaches):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text before them
               is content (Qwen2.5, Qwen3, Hermes and many others)
  llama3_json  the whole output is `{"name": ..., "parameters": {...}}`, several joined by `;` (Llama 3.x)
`tool_choice: "required"` or a named function is enforced by a grammar instead (pagoda.wire.tool_calls: the
request's constraint, built as the request is validated, and its output read back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.wire.tool_calls import ToolCall, call_from_json, forced_calls


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # text that is not a tool call
    tool_calls: list[ToolCall]


class ToolCallParser(Protocol):
    def parse(self, text: str, finished: bool) -> ParsedOutput:
        """The calls complete in `text` so far, and the content that is surely not part of a call (while
        not finished, a tail that may begin a call is held back)."""
        ...


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedOutput(text if finished else text[: len(text) - _held_back(text, self.OPEN)], [])
        calls: list[ToolCall] = []
        position = start
        while position >= 0:
            body_start = position + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            if end < 0 and not finished:
                break  # still being written
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = _decode_call(body, "arguments")
            if call is None:  # not a well-formed call: the whole output is content, as the model wrote it
                return ParsedOutput(text if finished else text[:start], [] if finished else calls)
            calls.append(call)
            if end < 0:
                break
            position = text.find(self.OPEN, end + len(self.CLOSE))
        return ParsedOutput(text[:start].rstrip(), calls)


class Llama3JsonParser:
    SEPARATOR = ";"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return ParsedOutput(text, [])
        if not finished:
            return ParsedOutput("", [])  # a call is being written: its parts are parsed when it ends
        calls = []
        for part in _split_objects(stripped, self.SEPARATOR):
            call = _decode_call(part, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput("", calls)


def _decode_call(body: str, arguments_key: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body), arguments_key)
    except json.JSONDecodeError:
        return None


def _split_objects(text: str, separator: str) -> list[str]:
    """JSON objects joined by `separator`; each part as text (an unparsable rest is one last part)."""
    decoder, parts, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            parts.append(text[position:])
            break
        parts.append(text[position:end])
        position = end
        while position < len(text) and (text[position].isspace() or text[position] == separator):
            position += 1
    return parts


TOOL_CALL_PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


@dataclass(frozen=True)
class ToolCallReader:
    """How a chat choice's text becomes content and tool calls: the model's own format (`tool_choice` "auto",
    read by `parser`) or a forced call (`forced_choice`: "required" or a named function)."""

    parser: ToolCallParser | None = None
    forced_choice: str | dict[str, Any] | None = None

    def read(self, text: str, finished: bool) -> ParsedOutput:
        if self.parser is not None:
            return self.parser.parse(text, finished)
        if not finished or self.forced_choice is None:
            return ParsedOutput("", [])  # a forced call is JSON: it is read whole, at the end
        calls = forced_calls(text, self.forced_choice)
        return ParsedOutput("" if calls else text, calls)  # cut short (length): what was written, as text
