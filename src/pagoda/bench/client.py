"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk (httpx, no retries).

Timestamps are taken when a server-sent event's line arrives; a chunk "carries content" when its first
choice has non-empty `text` (completions) or `delta.content` (chat). Role-only and usage-only chunks do not.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from pagoda.bench.load import Sender
from pagoda.bench.records import RequestRecord
from pagoda.bench.workloads import Conversation, is_messages

APIS = ("completions", "chat")


@dataclass(frozen=True)
class Endpoint:
    """A server to measure. `root` has no `/v1`: `/tokenize` and `/health` live there."""

    root: str
    api: str = "completions"
    model: str | None = None
    name: str = ""
    api_key: str | None = None
    # How a request names its tenant: in this header (a gateway's, as a tenants file's `tenant_header`), or by
    # sending that tenant's API key instead of `api_key`.
    tenant_header: str | None = None
    tenant_keys: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str, api: str = "completions", model: str | None = None,
              api_key: str | None = None) -> Endpoint:
        """`[NAME=]URL`, with or without a trailing `/v1` (or a full `/v1/completions` path)."""
        name, _, url = text.partition("=") if "=" in text.split("://")[0] else ("", "", text)
        parts = urlsplit(url if "://" in url else f"http://{url}")
        path = parts.path.rstrip("/")
        for suffix in ("/chat/completions", "/completions", "/v1"):
            path = path.removesuffix(suffix)
        root = urlunsplit((parts.scheme, parts.netloc, path, "", "")).rstrip("/")
        return cls(root=root, api=api, model=model, name=name or parts.netloc, api_key=api_key)

    @property
    def url(self) -> str:
        return f"{self.root}/v1/{'chat/completions' if self.api == 'chat' else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def headers_for(self, tenant: str | None) -> dict[str, str]:
        """A request's headers: the tenant's key in place of `api_key` where it has one, its name in the tenant
        header where there is one."""
        if tenant is None:
            return self.headers
        key = dict(self.tenant_keys).get(tenant, self.api_key)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if self.tenant_header:
            headers[self.tenant_header] = tenant
        return headers


@dataclass(frozen=True)
class RequestOptions:
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def request_body(endpoint: Endpoint, conversation: Conversation, turn_index: int, earlier_outputs: list[str],
                 options: RequestOptions) -> dict[str, Any]:
    """The JSON body of a conversation's turn, with the earlier turns and the server's answers before it."""
    turns = conversation.turns
    turn = turns[turn_index]
    body: dict[str, Any] = {"model": endpoint.model, "max_tokens": turn.max_tokens,
                            "temperature": options.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if options.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: sent only when asked, a strict server may refuse it
    if turn.priority is not None:
        body["priority"] = turn.priority  # vLLM's; the server must run --scheduling-policy priority
    if endpoint.api == "completions":
        if is_messages(turn.prompt):
            raise ValueError("chat messages need --api chat")
        if turn_index == 0:
            body["prompt"] = turn.prompt
        elif not isinstance(turn.prompt, str):
            raise ValueError("a later turn of a completions conversation needs a text prompt")
        else:
            history = "".join(f"{t.prompt}{out}" for t, out in zip(turns[:turn_index], earlier_outputs))
            body["prompt"] = history + turn.prompt
    else:
        messages: list[dict[str, Any]] = []
        for earlier, output in zip(turns[:turn_index], earlier_outputs):
            messages += [{"role": "user", "content": earlier.prompt}, {"role": "assistant", "content": output}]
        messages += turn.prompt if is_messages(turn.prompt) else [{"role": "user", "content": turn.prompt}]
        body["messages"] = messages
    body.update(options.extra_body)
    return body


def parse_event(line: str) -> dict[str, Any] | str | None:
    """One SSE line: a JSON payload, "[DONE]", or None (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    return json.loads(data) if data else None


def chunk_content(payload: dict[str, Any]) -> str:
    """The text a streamed chunk adds: choices[0].text (completions) or choices[0].delta.content (chat)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def error_type(error: BaseException) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    if isinstance(error, httpx.ConnectError):
        return "connect_error"
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "disconnected"
    if isinstance(error, httpx.HTTPError):
        return "transport_error"
    if isinstance(error, (json.JSONDecodeError, ValueError, KeyError, TypeError)):
        return "bad_response"
    return type(error).__name__


async def send(http: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any], record: RequestRecord,
               origin: float) -> str:
    """Streams one request, filling `record` (sent, chunk times, end, usage, error); returns the output text."""
    pieces: list[str] = []
    started = time.monotonic()
    record.sent = started - origin
    try:
        async with http.stream("POST", endpoint.url, json=body, headers=endpoint.headers_for(record.tenant)) \
                as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                record.error, record.error_detail = f"http_{response.status_code}", detail[:300]
                return ""
            done = await _read_stream(response, record, pieces, started)
        if record.error is None and not done:
            record.error, record.error_detail = "incomplete", "the stream ended without [DONE]"
        elif record.error is None and not record.chunk_times:
            record.error, record.error_detail = "no_content", "no chunk carried any content"
    except Exception as error:  # every failure is a counted outcome, never a crash of the run
        record.error, record.error_detail = error_type(error), f"{type(error).__name__}: {error}"[:300]
    finally:
        record.end = time.monotonic() - started
    text = "".join(pieces)
    record.output_chars = len(text)
    return text


async def _read_stream(response: httpx.Response, record: RequestRecord, pieces: list[str], started: float) -> bool:
    async for line in response.aiter_lines():
        arrived = time.monotonic() - started
        event = parse_event(line)
        if event is None:
            continue
        if isinstance(event, str):  # "[DONE]"
            return True
        if "error" in event:
            error = event["error"]
            record.error = "stream_error"
            record.error_detail = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
            continue
        content = chunk_content(event)
        if content:
            record.chunk_times.append(arrived)
            pieces.append(content)
        choices = event.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            record.finish_reason = choices[0]["finish_reason"]
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens")
            record.output_tokens = usage.get("completion_tokens")
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return False


def make_http_client(timeout_s: float) -> httpx.AsyncClient:
    """No connection limit (a pool queue would be client-side queueing), no proxies, explicit timeouts."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def make_sender(http: httpx.AsyncClient, endpoint: Endpoint, options: RequestOptions) -> Sender:
    """The load generator's sender: builds a turn's body, streams it, returns (record, output text)."""

    async def sender(conversation: Conversation, turn_index: int, earlier_outputs: list[str],
                     origin: float) -> tuple[RequestRecord, str]:
        turn = conversation.turns[turn_index]
        record = RequestRecord(f"c{conversation.index}-t{turn_index}", conversation.index, turn_index,
                               max_tokens=turn.max_tokens, priority=turn.priority, tenant=turn.tenant,
                               expected_prompt_tokens=turn.expected_prompt_tokens if turn_index == 0 else None)
        try:
            body = request_body(endpoint, conversation, turn_index, earlier_outputs, options)
        except ValueError as error:
            record.error, record.error_detail = "bad_request", str(error)
            return record, ""
        return record, await send(http, endpoint, body, record, origin)

    return sender


async def scrape_metrics(http: httpx.AsyncClient, endpoint: Endpoint) -> str | None:
    """GET /metrics (Prometheus text) with the endpoint's key; None when the server has none or refuses:
    what it exports is extra information, never a reason to fail a run."""
    try:
        response = await http.get(f"{endpoint.root}/metrics", headers=endpoint.headers)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
