"""Tool calling: how a chat choice's text becomes content and OpenAI's `tool_calls`.

`tool_choice: "auto"` lets the model decide; its output is read by the parser named with `--tool-call-parser`
(the format its chat template teaches: pagoda.server.tool_parsers). `tool_choice: "required"` or a named
function is enforced by a grammar instead (pagoda.wire.tool_calls: the request's constraint, built as the
request is validated, and its output read back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagoda.sampling import SamplingParams
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS, ParsedOutput, ToolCallParser
from pagoda.wire.tool_calls import forced_calls


@dataclass(frozen=True)
class ToolCallReader:
    """How a chat choice's text becomes content and tool calls: the model's own format (`tool_choice` "auto",
    read by `parser`) or a forced call (`forced_choice`: "required" or a named function)."""

    parser: ToolCallParser | None = None
    forced_choice: str | dict[str, Any] | None = None

    @classmethod
    def auto(cls, parser_name: str) -> ToolCallReader:
        return cls(parser=TOOL_CALL_PARSERS[parser_name]())

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as its reading needs it: a format whose call marker is a special token
        (mistral's `[TOOL_CALLS]`) needs the special tokens kept in the text, else no call could be seen."""
        if self.parser is not None and self.parser.reads_special_tokens and params.skip_special_tokens:
            return replace(params, skip_special_tokens=False)
        return params

    def read(self, text: str, finished: bool) -> ParsedOutput:
        if self.parser is not None:
            return self.parser.parse(text, finished)
        if not finished or self.forced_choice is None:
            return ParsedOutput("", [])  # a forced call is JSON: it is read whole, at the end
        calls = forced_calls(text, self.forced_choice)
        return ParsedOutput("" if calls else text, calls)  # cut short (length): what was written, as text
