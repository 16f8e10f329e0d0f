"""API keys, for `pagoda serve` and `pagoda route` alike: where they come from (flags, a file, the environment),
how a presented key is checked (in constant time, against every key), and the ASGI guard that answers 401
before a request's body is read.

Neither the server's nor the router's: both import it, and it imports neither. Each app passes the guard its
own way of answering an error (both answer in OpenAI's shape).
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV_VARS = ("PAGODA_API_KEY", "VLLM_API_KEY")
# Probes and scrapes carry no key (load balancers, Prometheus); they read no request data and cost no compute.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})

# (status, message, headers) -> the response to send: each app's own error shape.
ErrorResponse = Callable[[int, str, dict[str, str]], ASGIApp]


@dataclass(frozen=True)
class ApiKeys:
    """The keys a client may present (any one of them); none configured means no check."""

    keys: tuple[bytes, ...] = ()
    guard_metrics: bool = False

    @classmethod
    def gather(cls, given: Iterable[str] = (), key_file: str | Path | None = None,
               environ: Mapping[str, str] | None = None, guard_metrics: bool = False) -> ApiKeys:
        """The keys from flags, a file (one per line; blank lines and # comments skipped) and the environment
        (PAGODA_API_KEY, and vLLM's VLLM_API_KEY)."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        keys = list(given)
        if key_file is not None:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        keys += [env[name] for name in API_KEY_ENV_VARS if env.get(name)]
        if any(not key or key != key.strip() for key in keys):
            raise ValueError("API keys must be non-empty and carry no surrounding whitespace")
        if guard_metrics and not keys:
            raise ValueError("--guard-metrics needs an API key (--api-key, --api-key-file or PAGODA_API_KEY)")
        return cls(tuple(dict.fromkeys(key.encode() for key in keys)), guard_metrics)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ApiKeys:
        """The keys `add_api_key_arguments`' flags and the environment give."""
        return cls.gather(args.api_key or (), args.api_key_file, guard_metrics=args.guard_metrics)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def guards(self, path: str) -> bool:
        if not self.keys:
            return False
        return path not in OPEN_PATHS or (self.guard_metrics and path == "/metrics")

    def accepts(self, authorization: bytes | str | None) -> bool:
        """`Authorization: Bearer <key>`, the scheme in any case. Every key is compared, in constant time,
        so the time taken tells nothing about which key, or how much of one, matched."""
        if isinstance(authorization, str):
            authorization = authorization.encode()
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        presented = token.strip()
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and scheme.lower() == b"bearer"


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """--api-key (repeatable), --api-key-file and --guard-metrics, the same for every command that takes keys."""
    parser.add_argument("--api-key", action="append", default=None,
                        help="require `Authorization: Bearer <key>` on every route but /health, /version and /metrics; "
                             "repeat for several keys (also: --api-key-file, PAGODA_API_KEY or VLLM_API_KEY)")
    parser.add_argument("--api-key-file", default=None, help="a file of API keys, one per line (# comments)")
    parser.add_argument("--guard-metrics", action="store_true", help="require an API key on /metrics too")


class KeyCheck(Protocol):
    """What the guard asks: ApiKeys, or a holder of keys that change while serving (server/tenancy.py)."""

    def guards(self, path: str) -> bool: ...

    def accepts(self, authorization: bytes | str | None) -> bool: ...


class ApiKeyGuard:
    """401 for a guarded route without a valid key, before the body is read. Plain ASGI (no
    BaseHTTPMiddleware), so it sees every route, streamed responses included. `public_paths`: static files
    that hold no data (the web UI's pages, which ask for the key and send it with their own calls)."""

    def __init__(self, app: ASGIApp, keys: KeyCheck, error_response: ErrorResponse,
                 public_paths: frozenset[str] = frozenset()) -> None:
        self.app, self.keys, self.error_response, self.public_paths = app, keys, error_response, public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = scope["type"] == "http" and path not in self.public_paths and self.keys.guards(path)
        if guarded and not self.keys.accepts(_authorization(scope)):
            refusal = self.error_response(401, "invalid or missing API key", {"WWW-Authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    """The raw Authorization header: a key is compared as the bytes the client sent."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            return bytes(value)
    return None
