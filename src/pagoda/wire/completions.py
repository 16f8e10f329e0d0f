"""/v1/completions' request: OpenAI's legacy completions, with vLLM's extensions (sampling.py)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from pagoda.sampling import DEFAULT_MAX_TOKENS
from pagoda.wire.base import Prompt, too_long
from pagoda.wire.limits import wire_limits
from pagoda.wire.sampling import SamplingRequest


class CompletionRequest(SamplingRequest):
    NULL_IS_DEFAULT = SamplingRequest.NULL_IS_DEFAULT | {"echo", "add_special_tokens"}
    UNSUPPORTED = {**SamplingRequest.UNSUPPORTED, "add_special_tokens": True, "prompt_embeds": None}

    prompt: Prompt
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's; only true (the tokenizer's special tokens) is supported
    prompt_embeds: str | list[str] | None = None  # vLLM's base64 tensors: not supported

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not isinstance(value[0], int):  # a list of prompts
            too_long(value, wire_limits().max_prompts, "prompts")
        return value

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompt_logprobs_wanted(self) -> int | None:
        """echo + logprobs returns the prompt's logprobs too (OpenAI's legacy completions)."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        token_ids = [p for p in prompt if isinstance(p, int)]
        if len(token_ids) == len(prompt):  # one prompt of token ids
            return [token_ids]
        return [p for p in prompt if not isinstance(p, int)]
