"""A client's view of one answer, for fuzz.py and soak.py: OpenAI's error shape, a POST that reads an event
stream event by event, and /health's bound.

Standard library only, so that scripts running in their own environment (fuzz.py, with schemathesis) can
use it as well as those in pagoda's.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ERROR_KEYS = {"message", "type", "param", "code"}
HEALTH_BOUND_S = 1.0  # /health must answer 200 within this, whatever else the server is doing
# How pagoda marks a failure that was confined to its own request (every other request is unaffected): this
# header's value on an error response, the error object's "scope" in an event stream.
ERROR_SCOPE_HEADER = "X-Pagoda-Error-Scope"
REQUEST_SCOPE = "request"


def error_problem(status: int, text: str) -> str | None:
    """What is wrong with an answer at first sight: a 5xx, or an error whose body is not OpenAI's
    {"error": {"message", "type", "param", "code"}} with the status as its code; None when nothing is."""
    if status >= 500:
        return "server error"
    if status < 400:
        return None
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return "error body is not OpenAI's shape"
    if not isinstance(error, dict) or not set(error) >= ERROR_KEYS or error["code"] != status:
        return "error body is not OpenAI's shape"
    return None


@dataclass
class Reply:
    """One POST's answer. `status` is None when the transport failed (then `transport_error` says how);
    `events` are the decoded `data:` payloads of an event stream, `text` the body of anything else."""

    status: int | None
    text: str = ""
    events: list[Any] = field(default_factory=list)
    transport_error: str | None = None
    finished_at: float = 0.0  # time.monotonic() when the last byte was read
    scope: str | None = None  # the ERROR_SCOPE_HEADER of an error response

    @property
    def error_events(self) -> list[dict]:
        """The errors the server sent inside a 200 event stream, e.g. when the request failed in the engine."""
        return [event["error"] for event in self.events if isinstance(event, dict) and "error" in event]

    def outcome(self) -> str:
        """A label to count answers by: the status, with the code of any error event ("200+error 500")."""
        if self.status is None:
            return "transport error"
        codes = [str(error.get("code")) if isinstance(error, dict) else "?" for error in self.error_events]
        label = f"{self.status}+error {','.join(codes)}" if codes else str(self.status)
        return f"{label} alone" if self.failed_alone() else label

    def server_error(self) -> bool:
        """A 5xx status, or a 5xx code in an error event of the stream."""
        if self.status is not None and self.status >= 500:
            return True
        return any(isinstance(error, dict) and isinstance(error.get("code"), int) and error["code"] >= 500
                   for error in self.error_events)

    def failed_alone(self) -> bool:
        """A server error that the server says failed this request alone."""
        if not self.server_error():
            return False
        if self.status is not None and self.status >= 500:
            return self.scope == REQUEST_SCOPE
        return all(isinstance(error, dict) and error.get("scope") == REQUEST_SCOPE for error in self.error_events)


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None, timeout: float = 120.0,
         on_event: Callable[[Any], None] | None = None) -> Reply:
    """POST `body` as JSON; an event stream is read line by line, calling `on_event` with each payload as it
    arrives (`data: [DONE]` is not one)."""
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)
    try:
        connection.request("POST", path, body=json.dumps(body).encode(),
                           headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        if not response.getheader("content-type", "").startswith("text/event-stream"):
            return Reply(response.status, response.read().decode(errors="replace"), finished_at=time.monotonic(),
                         scope=response.getheader(ERROR_SCOPE_HEADER))
        reply = Reply(response.status)
        for raw in response:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                event = {"error": {"message": f"undecodable event: {line[:200]}", "code": "undecodable"}}
            reply.events.append(event)
            if on_event is not None:
                on_event(event)
        reply.finished_at = time.monotonic()
        return reply
    except (OSError, http.client.HTTPException) as error:
        return Reply(None, transport_error=repr(error), finished_at=time.monotonic())
    finally:
        connection.close()


def health_problem(url: str) -> str | None:
    """None when /health answers 200 within HEALTH_BOUND_S, else what it did."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            status: object = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except OSError as error:
        status = repr(error)
    elapsed = time.monotonic() - started
    return None if status == 200 and elapsed <= HEALTH_BOUND_S else f"/health: {status} in {elapsed:.2f} s"


def metric_sum(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples over its labels, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
