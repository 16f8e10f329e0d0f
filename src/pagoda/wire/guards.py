"""What stands between a client and the server's work: the request-body bound, JSON decoding that cannot
stall the event loop, and (from pagoda.api_keys, shared with the router) the API-key check.

The middlewares are plain ASGI (no BaseHTTPMiddleware), so they see every route, streamed responses
included, and answer before the body is read: an unauthenticated or oversized request costs nothing.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.wire import OpenAIError, first_invalid_text

# Bodies up to this size are decoded by the C parser, which holds the GIL throughout (up to ~0.1 s for
# 256 KiB of nested lists on a busy 2-core machine). Larger ones use the pure-Python scanner on a worker
# thread: 10-20x slower on number-heavy JSON, but it yields the GIL every few milliseconds, so however large
# the body, the event loop (and /health) keeps answering.
C_PARSER_MAX_BYTES = 256 << 10
INLINE_PARSE_MAX_BYTES = 16 << 10  # below this, decoding on the event loop is cheaper than a thread hop


# --- request body ------------------------------------------------------------------------------------


# HTTPException is FastAPI's (a subclass of Starlette's): raised while FastAPI reads a body, it is passed through
# to the error handlers, where any other exception would become a generic 400.


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)")


class TooManyItems(HTTPException):
    def __init__(self, limit: int, field: str, what: str) -> None:
        self.param = field
        super().__init__(400, f"{field}: at most {limit} {what} (the model's context length); the body holds more")


# Routes whose body is essentially one list, of at most the model's context length (WireLimits.max_items)
# entries: (its field, what an entry is). Such a body with more commas than that can never be valid, and is
# refused as it arrives: counting costs nothing, while parsing a million ids takes seconds.
COUNTED_ROUTES = {"/detokenize": ("tokens", "token ids")}
OTHER_COMMAS = 16  # commas a valid body may hold outside its list: between its few other fields


def _max_items(scope: Scope) -> int | None:
    """The served model's context length, from the app's ServerState; None before a model is loaded, or for
    apps without one (the router)."""
    state = getattr(getattr(scope.get("app"), "state", None), "pagoda", None)
    wire_limits = getattr(state, "wire_limits", None)
    return wire_limits().max_items if callable(wire_limits) else None


class BodySizeLimit:
    """413 for a body over the limit: at once when Content-Length says so, else as soon as the bytes
    received pass it (chunked uploads), before anything parses them. On COUNTED_ROUTES, a 400 for a body
    with more list entries than the context holds, once it has arrived (so that the client, still sending,
    reads the answer) and before anything parses it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _raw_header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(_as_openai(BodyTooLarge(self.max_bytes)), scope, receive, send)
            return
        received, commas = 0, 0
        counted = COUNTED_ROUTES.get(scope.get("path", ""))
        max_items = _max_items(scope) if counted is not None else None

        async def counting_receive() -> Message:
            nonlocal received, commas
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > self.max_bytes:  # FastAPI passes an HTTPException from the body read through
                    raise BodyTooLarge(self.max_bytes)
                if counted is not None and max_items is not None:
                    commas += chunk.count(b",")
                    if commas > max_items + OTHER_COMMAS and not message.get("more_body", False):
                        raise TooManyItems(max_items, *counted)
            return message

        await self.app(scope, counting_receive, send)


@dataclass
class JsonDecoder:
    """Decodes request bodies off the event loop (see C_PARSER_MAX_BYTES) and refuses invalid Unicode.

    Its own small thread pool, so that large bodies cannot hold up tokenization or anything else."""

    workers: int = 2
    _executor: ThreadPoolExecutor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="pagoda-json")

    async def decode(self, body: bytes) -> Any:
        if len(body) <= INLINE_PARSE_MAX_BYTES:
            return decode_json(body)
        return await asyncio.get_running_loop().run_in_executor(self._executor, decode_json, body)


class InvalidText(HTTPException):
    """A string that is not valid Unicode: a 400 naming where it is (FastAPI passes HTTPExceptions raised
    while reading the body through unchanged)."""

    def __init__(self, path: tuple[str | int, ...]) -> None:
        self.param = str(path[0]) if path else None
        where = ".".join(map(str, path)) or "body"
        super().__init__(400, f"{where}: invalid Unicode (a lone surrogate) in a string")


class NotUtf8(HTTPException):
    def __init__(self, offset: int) -> None:
        super().__init__(400, f"the request body is not UTF-8 (at byte {offset}): JSON bodies must be UTF-8")


def decode_json(body: bytes) -> Any:
    """UTF-8 only (RFC 8259; json.loads would also take UTF-16 and UTF-32), then json.loads by the C parser,
    or for large bodies the pure-Python scanner; raises InvalidText for a lone surrogate anywhere (JSON's
    \\ud800 escapes, or their raw bytes, which are let through here to be reported with their path)."""
    try:
        text = body.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as error:
        raise NotUtf8(error.start) from None
    if len(body) <= C_PARSER_MAX_BYTES:
        value = json.loads(text, parse_constant=_not_json)
    else:  # a scanner of this call's own (its memo is not thread-safe)
        value = _PyDecoder().decode(text)
    if _may_hold_surrogates(body):
        path = first_invalid_text(value)
        if path is not None:
            raise InvalidText(path)
    return value


def _may_hold_surrogates(body: bytes) -> bool:
    """Cheap bytes test: no \\uD8xx-\\uDFxx escape and no 0xED byte (UTF-8 of U+D000-U+DFFF) means no
    surrogate; escaped emoji (surrogate pairs) and Hangul also pass here, and are then checked properly."""
    return b"\\ud" in body or b"\\uD" in body or b"\xed" in body


class NotJsonNumber(HTTPException):
    def __init__(self, literal: str) -> None:
        super().__init__(400, f"{literal} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _not_json(literal: str) -> Any:
    """Python's decoder takes NaN, Infinity and -Infinity; JSON does not."""
    raise NotJsonNumber(literal)


class _PyDecoder(json.JSONDecoder):
    def __init__(self) -> None:
        super().__init__(parse_constant=_not_json)
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]


# --- helpers -----------------------------------------------------------------------------------------


def _raw_header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _as_openai(error: HTTPException) -> OpenAIError:
    return OpenAIError(error.status_code, str(error.detail), getattr(error, "param", None))


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error JSON as a response, for middleware (which runs outside the app's exception handlers)."""
    return JSONResponse(OpenAIError(status, message).body(), status_code=status, headers=headers)


async def _send_error(error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
    await response(scope, receive, send)
