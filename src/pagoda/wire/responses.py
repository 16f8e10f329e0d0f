"""/v1/responses' request: OpenAI's Responses API, the subset vLLM serves (text and function-call items,
`instructions`, `previous_response_id`, function tools, structured output through `text.format`).

A Responses request is a chat request in other words: `chat_fields()` writes it as one, so that the chat route's
template rendering, sampling, tool calling and grammars serve it unchanged. Fields the engine cannot honour are
refused by name, as on the other routes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from pagoda.sampling import InvalidParam
from pagoda.wire.base import WireModel, too_long
from pagoda.wire.chat import ChatCompletionRequest, few_messages
from pagoda.wire.limits import MAX_TOOLS


class TextPart(WireModel):
    """A text part of a message item: the input's `input_text`, or an earlier answer's `output_text` given back."""

    model_config = ConfigDict(extra="ignore")  # output_text's annotations and logprobs, as the client echoes them

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(WireModel):
    model_config = ConfigDict(extra="ignore")  # an output item given back carries its id and status

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(WireModel):
    """A call the model made, given back with its result in the next request."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(WireModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningItem(WireModel):
    """An earlier answer's reasoning, given back: templates drop past turns' thinking, and so does pagoda."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ITEM_TYPES else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message=f"each input item's type must be one of {', '.join(ITEM_TYPES)} "
                                       f"(text only: no images, files or hosted tools)"),
]


class FunctionTool(WireModel):
    """The Responses API's function tool: the chat API's, one level flatter."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(WireModel):
    type: Literal["function"]
    name: str


class TextFormat(WireModel):
    """`text.format`: plain text, any JSON object, or JSON following a schema (the chat API's response_format,
    its json_schema fields one level up)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def as_response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise InvalidParam("text.format", "a json_schema format needs its schema")
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict,
                  "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# The chat request's names for what a Responses request calls otherwise (errors name the field the client sent).
CHAT_TO_RESPONSES_FIELD = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                           "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponsesChatRequest(ChatCompletionRequest):
    """A Responses request as the chat route takes it; its errors name the Responses fields."""

    def request_field(self, param: str) -> str:
        return CHAT_TO_RESPONSES_FIELD.get(param, param)


class ResponsesRequest(WireModel):
    NULL_IS_DEFAULT = frozenset({"stream", "store", "parallel_tool_calls", "temperature", "top_p"})
    # OpenAI's, not implemented: refused unless at their defaults
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "background": False, "conversation": None, "prompt": None, "reasoning": None, "top_logprobs": None,
        "max_tool_calls": None,
    }

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(fail_fast=True)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float = Field(default=1.0, le=2.0)
    top_p: float = 1.0
    stream: bool = False
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id} (for a bounded time)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop turns silently: refused
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _few_items(cls, value: Any) -> Any:
        return few_messages(value) if isinstance(value, list) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any) -> Any:
        too_long(value, MAX_TOOLS, "tools")
        return value

    def refuse_unsupported(self) -> None:
        for name, default in self.UNSUPPORTED.items():
            if getattr(self, name) != default:
                raise InvalidParam(name, "is not supported by this server")
        if self.include:
            raise InvalidParam("include", f"{self.include[0]!r} is not supported (nothing can be included)")

    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: consecutive function calls become one assistant message's
        tool_calls, a call's output a tool message; reasoning given back is dropped."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return messages

    def chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this is, after the stored conversation it continues (`history`). The instructions
        are this request's only: a continued response does not inherit the earlier ones (OpenAI's rule)."""
        self.refuse_unsupported()
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        fields: dict[str, Any] = {
            "messages": system + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
        }
        if self.tools:
            fields["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.as_response_format()
        return {k: v for k, v in fields.items() if v is not None}
