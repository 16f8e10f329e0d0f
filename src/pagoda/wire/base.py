"""What every request model shares: OpenAI's error, strict JSON types, the size checks made before
validation (their bounds: limits.py), and the Unicode check on parsed bodies."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import ErrorDetails


class OpenAIError(Exception):
    """Anything answered with OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
             429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
             504: "TimeoutError"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


# A 5xx that is one request's own fault (it failed alone in the engine; the server and the other requests are
# fine) carries this header with the value REQUEST_SCOPE; a streamed response, already 200, carries it as its
# error event's "scope". Routers read it: such an answer says nothing about the replica (router/faults.py).
ERROR_SCOPE_HEADER = "x-pagoda-error-scope"
REQUEST_SCOPE = "request"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())


Kind = Literal["completion", "chat"]


class WireModel(BaseModel):
    """Strict types on the wire: JSON's own types only, so `"yes"` is not a boolean and `false` not token id 0.
    (Strict floats still take JSON integers.)

    `NULL_IS_DEFAULT` names the fields that OpenAI or vLLM document as nullable but that have a default
    here: an explicit null there means the default."""

    model_config = ConfigDict(strict=True)
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.NULL_IS_DEFAULT:
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULL_IS_DEFAULT}
        return data


# Lists stop at their first bad element: a million bad ids make one error, not a million.
FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[int], FAIL_FAST]
Prompt = str | Annotated[list[str], FAIL_FAST] | TokenIds | Annotated[list[TokenIds], FAIL_FAST]


def too_long(value: Any, limit: int | None, what: str) -> None:
    """Raises when a raw (not yet validated) list, map or string is longer than limit."""
    if limit is not None and isinstance(value, (list, dict, str)) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}, got {len(value)}")


def error_message(error: ErrorDetails | dict[str, Any]) -> str:
    """A pydantic error's message, without pydantic's "Value error, " prefix on our own validators' errors."""
    if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    return str(error.get("msg"))


def located(error: ErrorDetails) -> str:
    """One pydantic error as `path.to.field: message` (error_message's)."""
    message = error_message(error)
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


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
