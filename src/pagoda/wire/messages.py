"""Chat messages as OpenAI documents them, one model per role: system, developer, user, assistant and tool.

A message of any other role (vLLM passes any role through to the template; OpenAI's deprecated `function`
role has no tool call to answer) is a 400, as is a tool message without `tool_call_id` or an assistant
message with neither content nor tool calls. Content is text: a string, or a list of text parts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Tag, model_validator

from pagoda.wire.base import WireModel

ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(WireModel):
    """One part of a message's content. Only text parts are supported: any other type (image_url,
    input_audio, file, refusal) is refused by name."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported (text only)")
        if self.text is None:
            raise ValueError("a text content part needs its text")
        return self


def _content_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


# Told apart by their JSON type, so that a bad part is one error, not one more for "not a string".
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")],
    Discriminator(_content_kind, custom_error_type="invalid_content",
                  custom_error_message="content must be a string or a list of content parts"),
]


class FunctionCall(WireModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(WireModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(WireModel):
    """What every role shares; the subclasses below are what the wire carries."""

    model_config = ConfigDict(extra="allow")  # vLLM's extra keys (reasoning_content, ...): not given to templates

    role: str
    content: Content | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: role, text content, and an assistant's `tool_calls` or a
        tool result's `tool_call_id` / `name` when given. A developer message is the system message of models
        trained before that role existed, which is every model pagoda serves."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class SystemMessage(ChatMessage):
    role: Literal["system"]
    content: Content


class DeveloperMessage(ChatMessage):
    role: Literal["developer"]
    content: Content


class UserMessage(ChatMessage):
    role: Literal["user"]
    content: Content


class AssistantMessage(ChatMessage):
    role: Literal["assistant"]
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        message = super().for_template()
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class ToolMessage(ChatMessage):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def for_template(self) -> dict[str, Any]:
        return {**super().for_template(), "tool_call_id": self.tool_call_id}


def _role_of(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return role if role in ROLES else None


AnyMessage = Annotated[
    Annotated[SystemMessage, Tag("system")] | Annotated[DeveloperMessage, Tag("developer")]
    | Annotated[UserMessage, Tag("user")] | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolMessage, Tag("tool")],
    Discriminator(_role_of, custom_error_type="invalid_role",
                  custom_error_message=f"each message needs a role among {', '.join(ROLES)}"),
]
