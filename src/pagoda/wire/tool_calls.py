"""A tool call in OpenAI's shape, and forced calls: `tool_choice` "required" or a named function, enforced by a
JSON grammar built from the functions' parameter schemas (`forced_constraint`, part of validating a chat
request) and read back from the output (`forced_calls`). One module for both, so the output's shape is
stated once."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagoda.structured import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from_json(payload: object, arguments_key: str) -> ToolCall | None:
    """{"name": str, "<arguments_key>": object} -> a ToolCall; anything else is not a call."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get(arguments_key, payload.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(payload["name"], json.dumps(arguments, ensure_ascii=False))


# --- forced calls: tool_choice "required" or a named function ---------------------------------------


def forced_constraint(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                      parallel_tool_calls: bool) -> StructuredOutputsParams:
    """A JSON grammar whose every instance is a valid call. Named: the function's arguments object.
    Required: a list of {"name", "parameters"} objects, one per call (exactly one unless parallel)."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if isinstance(tool_choice, dict):
        schema = _parameters_schema(functions[tool_choice["function"]["name"]])
        return StructuredOutputsParams(json=schema, error_param="tools")
    one_call = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters_schema(function)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for name, function in functions.items()
    ]}
    calls: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel_tool_calls:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls, error_param="tools")


def _parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}


def forced_calls(text: str, tool_choice: str | dict[str, Any]) -> list[ToolCall]:
    """The calls in a forced output (see forced_constraint); [] if it is incomplete (cut by max_tokens)."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(payload, ensure_ascii=False))]
    return [call for item in payload if (call := call_from_json(item, "parameters")) is not None]
