"""The fields /v1/completions and /v1/chat/completions share: sampling, output constraints, streaming, and
every other field OpenAI or vLLM documents for both, typed as documented.

A documented field that asks for something pagoda does not do is refused (400 naming it) unless it holds its
default: a client is never given output that silently ignores what it asked for. Fields that only label a
request for OpenAI's own bookkeeping (user, metadata, store, service_tier, prompt_cache_key,
safety_identifier) change nothing in the output and are accepted, typed, and ignored.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagoda.kv_transfer_params import KVTransferParams
from pagoda.sampling import InvalidParam, SamplingParams
from pagoda.structured import CONSTRAINT_KINDS, InvalidConstraint, StructuredOutputsParams
from pagoda.wire.base import TokenIds, WireModel, located, too_long
from pagoda.wire.limits import wire_limits


class StreamOptions(WireModel):
    NULL_IS_DEFAULT = frozenset({"include_usage", "continuous_usage_stats"})

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: refused when true
    continuous_usage_stats: bool = False  # vLLM's usage in every chunk: refused when true


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
                         "guided_whitespace_pattern": None, "structural_tag": None}


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


def _at_default(value: Any, default: Any) -> bool:
    """A field left at its default; for fields whose default is None, an empty or false value also asks for
    nothing."""
    if default is None:
        return value is None or value is False or value == [] or value == {}
    return bool(value == default)


class LogitsProcessorConstructor(WireModel):
    model_config = ConfigDict(extra="forbid")

    qualname: str
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None


class SamplingRequest(WireModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    Only the wire is checked here (types, and OpenAI's caps that vLLM's engine does not have): every
    sampling parameter's range is SamplingParams', whose errors name the request field (see sampling_params).
    """

    model_config = ConfigDict(extra="allow")  # undocumented fields are ignored, as vLLM does
    NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                                 "top_k", "min_p", "repetition_penalty", "skip_special_tokens", "ignore_eos",
                                 "min_tokens", "priority", "spaces_between_special_tokens", "length_penalty",
                                 "use_beam_search", "include_stop_str_in_output"})
    # Documented fields pagoda does not implement, with the one value each is accepted at (its default).
    UNSUPPORTED: ClassVar[dict[str, Any]] = {
        "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
        "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "allowed_token_ids": None,
        "bad_words": None, "prompt_logprobs": None, "logits_processors": None, "return_tokens_as_token_ids": None,
        "return_token_ids": None, "vllm_xargs": None, "mm_processor_kwargs": None,
        "request_id": None,
    }

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, le=2.0)  # OpenAI's cap; the engine takes any temperature >= 0
    top_p: float = 1.0
    n: int = Field(default=1, le=128)  # OpenAI's cap
    best_of: int | None = None  # as many samples as n (or null): there is no ranking of extra ones
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's labels for its own bookkeeping: typed, and without effect here
    user: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
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
    structured_outputs: dict[str, Any] | None = None  # vLLM's; checked by StructuredOutputsParams
    # vLLM's, not implemented: refused unless at their defaults (UNSUPPORTED)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logits_processors: list[str | LogitsProcessorConstructor] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (kv_transfer_params.py)
    vllm_xargs: dict[str, str | int | float] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    request_id: str | None = None

    @field_validator("response_format", mode="wrap")
    @classmethod
    def _name_the_nested_field(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> ResponseFormat | None:
        """Errors name the field inside response_format (json_schema.name, ...): the error body's param cannot."""
        try:
            parsed: ResponseFormat | None = handler(value)
        except ValidationError as error:
            raise PydanticCustomError("response_format", "; ".join(map(located, error.errors()))) from None
        return parsed

    @field_validator("stop_token_ids", "allowed_token_ids", "bad_words", mode="before")
    @classmethod
    def _bounded_token_lists(cls, value: Any) -> Any:
        too_long(value, wire_limits().max_stop_token_ids, "entries")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _few_short_stop_strings(cls, value: Any) -> Any:
        limits = wire_limits()
        too_long(value if isinstance(value, list) else None, limits.max_stop_strings, "stop strings")
        for stop in value if isinstance(value, list) else [value]:
            too_long(stop, limits.max_stop_string_chars, "characters in a stop string")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_biases(cls, value: Any) -> Any:
        too_long(value, wire_limits().max_logit_bias, "logit_bias entries")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_logprobs_wanted(self) -> int | None:
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
        for name, default in self.UNSUPPORTED.items():
            if not _at_default(getattr(self, name), default):
                raise InvalidParam(name, f"is not supported (only {json.dumps(default)} is accepted)")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParam("best_of", "is not supported unless equal to n (pagoda returns every sample it draws)")
        options = self.stream_options
        if options is not None and (options.include_obfuscation or options.continuous_usage_stats):
            raise InvalidParam("stream_options", "include_obfuscation and continuous_usage_stats are not supported")

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
            prompt_logprobs=self.prompt_logprobs_wanted(),
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=self.wanted_max_tokens(),
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            kv_transfer_params=None if self.kv_transfer_params is None else KVTransferParams.from_dict(
                self.kv_transfer_params),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)
