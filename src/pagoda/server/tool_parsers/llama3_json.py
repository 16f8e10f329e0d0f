"""`llama3_json`: the whole output is `{"name": ..., "parameters": {...}}`, several joined by `;` (Llama 3.x)."""

from __future__ import annotations

import json

from pagoda.server.tool_parsers.base import ParsedOutput, decode_call


class Llama3JsonParser:
    SEPARATOR = ";"
    reads_special_tokens = False

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        stripped = text.lstrip()
        if not stripped.startswith("{"):
            return ParsedOutput(text, [])
        if not finished:
            return ParsedOutput("", [])  # a call is being written: its parts are parsed when it ends
        calls = []
        for part in _split_objects(stripped, self.SEPARATOR):
            call = decode_call(part, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput("", calls)


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
