"""/tokenize's and /detokenize's requests (vLLM's)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import field_validator, model_validator

from pagoda.text.tokenizer import RENDERER_ARGUMENTS
from pagoda.wire.base import FAIL_FAST, TokenIds, WireModel, too_long
from pagoda.wire.chat import few_messages
from pagoda.wire.limits import wire_limits
from pagoda.wire.messages import AnyMessage


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[AnyMessage], FAIL_FAST] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's extra variables, as in a chat

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return few_messages(value)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_renderers_own(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RENDERER_ARGUMENTS & set(value or {}))
        if taken:
            raise ValueError(f"may not set {', '.join(taken)}: the request's own fields do")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: TokenIds

    @field_validator("tokens", mode="before")
    @classmethod
    def _few_tokens(cls, value: Any) -> Any:
        too_long(value, wire_limits().max_items, "token ids (the model's context length)")
        return value
