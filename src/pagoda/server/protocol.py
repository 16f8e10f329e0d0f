"""OpenAI request/response shapes (with vLLM's extensions), validated at the door."""

from __future__ import annotations

import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from pagoda.sampling import InvalidParam, SamplingParams
from pagoda.server.tools import forced_constraint
from pagoda.structured import CONSTRAINT_KINDS, InvalidConstraint, StructuredOutputsParams


class OpenAIError(Exception):
    """Anything answered with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
             429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
             504: "TimeoutError"}

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- what the wire may carry ----------------------------------------------------------------------


@dataclass(frozen=True)
class WireLimits:
    """Bounds on a request's size checked before its fields are validated, so that a huge list or map is
    refused at the cost of len(), not of validating every element. Set per request (WIRE_LIMITS)."""

    max_prompts: int = 256  # prompts in one completion request (prompts x n is checked after validation)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_logit_bias: int = 1024
    max_stop_token_ids: int = 1024  # fixed: more stop ids than this is no use case, only validation work
    max_items: int | None = None  # messages, or token ids to detokenize: max_model_len once a model is loaded


MAX_TOOLS = 128  # OpenAI's bound on functions per request
WIRE_LIMITS: ContextVar[WireLimits] = ContextVar("wire_limits")  # set per request by the app


def wire_limits() -> WireLimits:
    return WIRE_LIMITS.get(_DEFAULT_LIMITS)


_DEFAULT_LIMITS = WireLimits()


class WireModel(BaseModel):
    """Strict types on the wire: JSON's own types only, so `"yes"` is not a boolean and `false` not token id 0.
    (Strict floats still take JSON integers.)"""

    model_config = ConfigDict(strict=True)


# Lists stop at their first bad element: a million bad ids make one error, not a million.
_FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[int], _FAIL_FAST]
Prompt = str | Annotated[list[str], _FAIL_FAST] | TokenIds | Annotated[list[TokenIds], _FAIL_FAST]


def _too_long(value: Any, limit: int | None, what: str) -> None:
    """Raises when a raw (not yet validated) list, map or string is longer than limit."""
    if limit is not None and isinstance(value, (list, dict, str)) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}, got {len(value)}")


def first_invalid_text(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path to a string (or key) in parsed JSON that is not valid Unicode (a lone surrogate, which JSON's
    \\ud800 escapes can carry), or None when every string is valid. Allocates nothing per number or valid
    string: a body of millions of token ids is walked at the cost of one loop."""
    if isinstance(value, str):
        return None if _is_valid_text(value) else path
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, path)] if isinstance(value, (dict, list)) else []
    while stack:
        container, where = stack.pop()
        entries = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in entries:
            if isinstance(key, str) and not _is_valid_text(key):
                return (*where, key.encode("utf-8", "backslashreplace").decode())
            if isinstance(child, str):
                if not _is_valid_text(child):
                    return (*where, key)
            elif isinstance(child, (dict, list)):
                stack.append((child, (*where, key)))
    return None


def _is_valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StreamOptions(WireModel):
    include_usage: bool = False


# --- structured outputs ------------------------------------------------------------------------------

# vLLM's structured_outputs has options besides the constraint. Each is accepted at its default (None or False);
# any other value asks for something pagoda does not do, and is refused rather than ignored. Honoured whatever
# their value: disable_fallback (there is no other grammar engine to fall back to) and disable_any_whitespace
# (JSON is always written on one line with ", " and ": ", which any-whitespace JSON also allows).
_ALWAYS_HONOURED_OPTIONS = frozenset({"disable_fallback", "disable_any_whitespace"})
# vLLM's former top-level fields for the same constraints: refused, so that a client written for them does
# not get unconstrained output.
_LEGACY_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                         "guided_grammar": "grammar", "guided_decoding_backend": None,
                         "guided_whitespace_pattern": None}


class JsonSchemaFormat(WireModel):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow a BaseModel attribute
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(WireModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and allowed only with it")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, error_param="response_format")
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.schema_, error_param="response_format")
        return None


def _vllm_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's structured_outputs object; StructuredOutputsParams checks the constraint and names the field."""
    for key, value in fields.items():
        at_default = value is None or value is False
        if key not in CONSTRAINT_KINDS and key not in _ALWAYS_HONOURED_OPTIONS and not at_default:
            raise InvalidConstraint(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported")
    return StructuredOutputsParams(**{kind: fields[kind] for kind in CONSTRAINT_KINDS if fields.get(kind) is not None})


def _located(error: ErrorDetails) -> str:
    """One pydantic error as `path.to.field: message`, without pydantic's "Value error, " prefix."""
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


class SamplingRequest(WireModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Only the wire is checked here (types, and OpenAI's caps that vLLM's engine does not have): every
    sampling parameter's range is SamplingParams', whose errors name the request field (see sampling_params).
    """

    model_config = ConfigDict(extra="allow")  # unknown fields (user, ...) are ignored, as OpenAI does

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, le=2.0)  # OpenAI's cap; the engine takes any temperature >= 0
    top_p: float = 1.0
    n: int = Field(default=1, le=128)  # OpenAI's cap
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0  # vLLM's: lower runs first; only under --scheduling-policy priority (else a 400)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's; checked by StructuredOutputsParams

    @field_validator("response_format", mode="wrap")
    @classmethod
    def _name_the_nested_field(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> ResponseFormat | None:
        """Errors name the field inside response_format (json_schema.name, ...): the error body's param cannot."""
        try:
            parsed: ResponseFormat | None = handler(value)
        except ValidationError as error:
            raise PydanticCustomError("response_format", "; ".join(map(_located, error.errors()))) from None
        return parsed

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _bounded_stop_token_ids(cls, value: Any) -> Any:
        _too_long(value, wire_limits().max_stop_token_ids, "stop_token_ids")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _few_short_stop_strings(cls, value: Any) -> Any:
        limits = wire_limits()
        _too_long(value if isinstance(value, list) else None, limits.max_stop_strings, "stop strings")
        for stop in value if isinstance(value, list) else [value]:
            _too_long(stop, limits.max_stop_string_chars, "characters in a stop string")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, value: Any) -> Any:
        _too_long(value, wire_limits().max_logit_bias, "logit_bias entries")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value):
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_logprobs(self) -> int | None:
        return None

    def request_field(self, param: str) -> str:
        """The request field a SamplingParams parameter came from: the one its errors must name."""
        return param

    def sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        """The engine's parameters. Raises a ValueError whose `param` names the request field at fault: an
        InvalidParam for a value out of range or a feature the server lacks, an InvalidConstraint for a
        malformed output constraint."""
        self.refuse_unsupported()
        try:
            return self._build_sampling_params(num_logprobs)
        except InvalidParam as error:
            raise error.renamed(self.request_field(error.param)) from error
        except InvalidConstraint as error:
            message = str(error)  # some lack a subject ("must contain at least one string"): the field is it
            if not message.startswith(error.param):
                raise InvalidConstraint(error.param, f"{error.param}: {message}") from error
            raise

    def refuse_unsupported(self) -> None:
        """Raises InvalidParam for a field that asks for what the server cannot do: never ignored silently."""
        extra = self.model_extra or {}
        for name, kind in _LEGACY_GUIDED_FIELDS.items():
            if extra.get(name) is not None:
                instead = f": use structured_outputs.{kind}" if kind else ""
                raise InvalidParam(name, f"is not supported{instead}")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint, from response_format or from vLLM's structured_outputs (not both)."""
        from_format = self.response_format.constraint() if self.response_format is not None else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise InvalidConstraint("structured_outputs", "give response_format or structured_outputs, not both")
        return _vllm_structured_outputs(self.structured_outputs)

    def _build_sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            prompt_logprobs=self.prompt_logprobs(),
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=self.wanted_max_tokens(),
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not isinstance(value[0], int):  # a list of prompts
            _too_long(value, wire_limits().max_prompts, "prompts")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompt_logprobs(self) -> int | None:
        """echo + logprobs returns the prompt's logprobs too (OpenAI's legacy completions)."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class ChatMessage(WireModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: role, text content, and an assistant's `tool_calls` or a
        tool result's `tool_call_id` / `name` when given."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        extra = self.model_extra or {}
        for key in ("tool_calls", "tool_call_id", "name"):
            if extra.get(key) is not None:
                message[key] = extra[key]
        return message


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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # with tools, "auto" when not given (OpenAI's default)
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated forms of tools and tool_choice
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return _few_messages(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any) -> Any:
        _too_long(value, MAX_TOOLS, "tools")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.functions and self.function_call != "none":
            raise InvalidParam("functions", "is not supported: use tools (and tool_choice)")
        if self.function_call not in (None, "none"):
            raise InvalidParam("function_call", "is not supported: use tool_choice (and tools)")

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


def _few_messages(value: Any) -> Any:
    """Every message costs at least one token: more than the context holds can never fit."""
    _too_long(value, wire_limits().max_items, "messages (the model's context length)")
    return value


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], _FAIL_FAST] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return _few_messages(value)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: TokenIds

    @field_validator("tokens", mode="before")
    @classmethod
    def _few_tokens(cls, value: Any) -> Any:
        _too_long(value, wire_limits().max_items, "token ids (the model's context length)")
        return value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())


Kind = Literal["completion", "chat"]
