"""Tool-call parsers: the model's own tool-call text (`tool_choice: "auto"`) read into OpenAI's `tool_calls`,
one module per format, named as vLLM names them (`--tool-call-parser`):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (hermes.py)
  llama3_json  `{"name": ..., "parameters": {...}}`, several joined by `;` (llama3_json.py)
  mistral      `[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call (mistral.py)
  pythonic     `[get_weather(city="Oslo"), add(a=1, b=2)]` (pythonic.py)
What they share, and the streaming contract each keeps, is in base.py.
"""

from __future__ import annotations

from pagoda.server.tool_parsers.base import ParsedOutput, ToolCallParser
from pagoda.server.tool_parsers.hermes import HermesParser
from pagoda.server.tool_parsers.llama3_json import Llama3JsonParser
from pagoda.server.tool_parsers.mistral import MistralParser
from pagoda.server.tool_parsers.pythonic import PythonicParser
from pagoda.tool_parser_names import TOOL_CALL_PARSER_NAMES

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}
if tuple(TOOL_CALL_PARSERS) != TOOL_CALL_PARSER_NAMES:
    raise ImportError("pagoda.tool_parser_names must list the registered tool-call parsers, in order")

__all__ = ["TOOL_CALL_PARSERS", "HermesParser", "Llama3JsonParser", "MistralParser", "ParsedOutput",
           "PythonicParser", "ToolCallParser"]
