"""The bounds on what one request may ask: the server's (each a `pagoda serve` flag, defaults here only) and
those of them checked on the raw body before its fields are validated (WireLimits, derived from them)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """The bounds on what one request may ask of the server (each a `pagoda serve` flag)."""

    max_request_body_bytes: int = 8 << 20
    max_chars_per_token: float = 32.0  # a prompt longer than max_model_len x this can never fit
    max_sequences_per_request: int = 256  # prompts x n
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_logit_bias: int = 1024
    request_timeout: float | None = 600.0  # seconds from arrival to the last token; 0 or None: no deadline
    # seconds a client has to send a request's headers and body, from its first byte (or from the
    # connection's opening); then the connection is closed (server/read_deadline.py)
    request_read_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_chars_per_token", "max_sequences_per_request",
                     "max_stop_strings", "max_stop_string_chars", "max_logit_bias", "request_read_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.request_timeout is not None and self.request_timeout < 0:
            raise ValueError("request_timeout must not be negative (0: no deadline)")


MAX_TOOLS = 128  # OpenAI's bound on functions per request
MAX_STOP_TOKEN_IDS = 1024  # fixed: more stop ids than this is no use case, only validation work


@dataclass(frozen=True)
class WireLimits:
    """Bounds on a request's size checked before its fields are validated, so that a huge list or map is
    refused at the cost of len(), not of validating every element. Set per request (WIRE_LIMITS); made from
    ServerLimits by `of`, so each bound has one default."""

    max_prompts: int  # prompts in one completion request (prompts x n is checked after validation)
    max_stop_strings: int
    max_stop_string_chars: int
    max_logit_bias: int
    max_items: int | None = None  # messages, or token ids to detokenize: max_model_len once a model is loaded
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS

    @classmethod
    def of(cls, limits: ServerLimits, max_items: int | None = None) -> WireLimits:
        return cls(max_prompts=limits.max_sequences_per_request, max_stop_strings=limits.max_stop_strings,
                   max_stop_string_chars=limits.max_stop_string_chars, max_logit_bias=limits.max_logit_bias,
                   max_items=max_items)


WIRE_LIMITS: ContextVar[WireLimits] = ContextVar("wire_limits")  # set per request by the app


def wire_limits() -> WireLimits:
    """The limits in force: the serving app's, else (the router, a request model used on its own) the defaults."""
    return WIRE_LIMITS.get(_DEFAULT_LIMITS)


_DEFAULT_LIMITS = WireLimits.of(ServerLimits())
