"""/v1/chat/completions' request: messages (messages.py), tools and tool choice, and the chat-only fields of
OpenAI and vLLM."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagoda.sampling import InvalidParam
from pagoda.structured import InvalidConstraint, StructuredOutputsParams
from pagoda.text.tokenizer import RENDERER_ARGUMENTS
from pagoda.wire.base import WireModel, too_long
from pagoda.wire.limits import MAX_TOOLS, wire_limits
from pagoda.wire.messages import AnyMessage
from pagoda.wire.sampling import SamplingRequest
from pagoda.wire.tool_calls import forced_constraint


class FunctionDefinition(WireModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments always follow `parameters` when a call is forced


class ToolDefinition(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def few_messages(value: Any) -> Any:
    """Every message costs at least one token: more than the context holds can never fit."""
    too_long(value, wire_limits().max_items, "messages (the model's context length)")
    return value


class ChatCompletionRequest(SamplingRequest):
    NULL_IS_DEFAULT = SamplingRequest.NULL_IS_DEFAULT | {"logprobs", "parallel_tool_calls", "add_generation_prompt",
                                                         "echo", "continue_final_message", "add_special_tokens",
                                                         "include_reasoning"}
    UNSUPPORTED = {**SamplingRequest.UNSUPPORTED, "echo": False, "continue_final_message": False,
                   "add_special_tokens": False, "documents": None, "chat_template": None,
                   "reasoning_effort": None, "verbosity": None, "audio": None,
                   "prediction": None, "web_search_options": None}

    messages: list[AnyMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # with tools, "auto" when not given (OpenAI's default)
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated forms of tools and tool_choice
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None  # only ["text"] is supported
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out (the answer is still split from it)
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking, ...); never the renderer's own
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's and vLLM's, not implemented: refused unless at their defaults (UNSUPPORTED)
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return few_messages(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any) -> Any:
        too_long(value, MAX_TOOLS, "tools")
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        taken = sorted(RENDERER_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if taken:
            raise InvalidParam("chat_template_kwargs", f"may not set {', '.join(taken)}: the request's own fields do")
        if self.functions and self.function_call != "none":
            raise InvalidParam("functions", "is not supported: use tools (and tool_choice)")
        if self.function_call not in (None, "none"):
            raise InvalidParam("function_call", "is not supported: use tool_choice (and tools)")
        if self.modalities is not None and "audio" in self.modalities:
            raise InvalidParam("modalities", "is not supported beyond [\"text\"]")

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as OpenAI writes them, for the chat template and the forced-call grammar."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def resolved_tool_choice(self) -> Literal["none", "auto", "required"] | dict[str, Any]:
        """How tools apply: "none" (answer in text), "auto" (the model decides) or a forced call ("required",
        or a named function as a dict). Raises InvalidParam for a choice the tools cannot satisfy."""
        choice = self.tool_choice
        if not self.tools:
            if choice == "required" or isinstance(choice, NamedToolChoice):
                raise InvalidParam("tool_choice", "asks for a tool call, but no tools are given")
            return "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool.function.name for tool in self.tools}:
                raise InvalidParam("tool_choice", f"names the function {choice.function.name!r}, which is not "
                                                  f"among the tools")
            return choice.model_dump()
        return choice or "auto"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        choice = self.resolved_tool_choice()
        constraint = super().structured_outputs_params()
        if choice == "required" or isinstance(choice, dict):
            if constraint is not None:
                raise InvalidConstraint("tool_choice", "a forced tool call cannot be combined with "
                                                       "response_format or structured_outputs")
            return forced_constraint(self.tool_dicts(), choice, self.parallel_tool_calls)
        return constraint

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def request_field(self, param: str) -> str:
        if param == "logprobs":  # chat's logprobs is a switch; the count is top_logprobs
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param
