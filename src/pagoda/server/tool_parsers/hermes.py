"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number; the text before the first is
content (Qwen2.5, Qwen3, Hermes, and the built-in model)."""

from __future__ import annotations

from pagoda.server.tool_parsers.base import ParsedOutput, decode_call, held_back
from pagoda.wire.tool_calls import ToolCall


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    reads_special_tokens = False  # the tags are added tokens, but not special ones

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedOutput(text if finished else text[: len(text) - held_back(text, self.OPEN)], [])
        calls: list[ToolCall] = []
        position = start
        while position >= 0:
            body_start = position + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            if end < 0 and not finished:
                break  # still being written
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = decode_call(body, "arguments")
            if call is None:  # not a well-formed call: the whole output is content, as the model wrote it
                return ParsedOutput(text if finished else text[:start], [] if finished else calls)
            calls.append(call)
            if end < 0:
                break
            position = text.find(self.OPEN, end + len(self.CLOSE))
        return ParsedOutput(text[:start].rstrip(), calls)
