"""`pagoda route`'s HTTP side: an OpenAI-compatible proxy over the replicas, on the server's HTTP stack.

Every request is routed by `Router`, sent with `Forwarder`, and retried on another replica (after a jittered
backoff) when its replica fails (connection failure, 5xx) or refuses it (429), but only while nothing has
reached the client: a stream is handed to the client once the replica's first chunk is in, and a replica
failing after that ends the stream with an SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.router.core import Decision, Lease, NoReplicaAvailable, Router
from pagoda.router.events import subscribe_forever
from pagoda.router.policies import RoutedPrompt
from pagoda.router.poller import poll_forever
from pagoda.router.replica import Replica
from pagoda.router.tokens import PromptReader
from pagoda.server.guards import BodySizeLimit, JsonDecoder, ServerLimits
from pagoda.server.protocol import OpenAIError

logger = logging.getLogger("pagoda.route")

FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
RETURNED_HEADERS = ("content-type", "retry-after", "x-request-id")
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
SSE_EVENT = b"data:"


@dataclass(frozen=True)
class Attempt:
    """One try on one replica: the response to give the client, and whether another replica may be tried."""

    response: Response
    retry: bool


def _error(status: int, message: str, retry_after_s: float | None = None) -> JSONResponse:
    error = OpenAIError(status, message)
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse(error.body(), status_code=status, headers=headers)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class Forwarder:
    def __init__(self, router: Router, client: httpx.AsyncClient, rng: random.Random) -> None:
        self.router = router
        self.client = client
        self.rng = rng

    async def dispatch(self, path: str, body: bytes, headers: dict[str, str], prompt: RoutedPrompt,
                       stream: bool) -> Response:
        """Tries replicas until one answers (or none is left): the answer, or the last failure's."""
        tried: list[Replica] = []
        last: Response | None = None
        for attempt in range(self.router.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            try:
                decision = self.router.choose(prompt, exclude=tried)
            except NoReplicaAvailable as refusal:
                return last if last is not None else _error(refusal.status, str(refusal), refusal.retry_after_s)
            tried.append(decision.replica)
            lease = self.router.begin(decision)
            send = self._stream if stream else self._whole
            outcome = await send(path, body, headers, decision, lease)
            if not outcome.retry:
                return outcome.response
            last = outcome.response
        assert last is not None
        return last

    def _backoff(self, attempt: int) -> float:
        """Exponential, times a random factor in [0.5, 1.5): retries of many requests do not arrive together."""
        return float(self.router.config.retry_backoff_s * 2.0 ** (attempt - 1) * (0.5 + self.rng.random()))

    async def _whole(self, path: str, body: bytes, headers: dict[str, str], decision: Decision,
                     lease: Lease) -> Attempt:
        replica, succeeded = decision.replica, False
        try:
            try:
                upstream = await self.client.post(f"{replica.url}{path}", content=body, headers=headers)
            except httpx.HTTPError as error:
                return self._connection_failed(decision, error)
            refused = self._refused(decision, upstream, upstream.content)
            if refused is not None:
                return refused
            succeeded = upstream.status_code < 400
            if upstream.status_code == 200:
                self._observe_usage(decision, upstream.content)
            return Attempt(self._relayed(upstream, upstream.content), retry=False)
        finally:  # also on cancellation: the client went away
            lease.finish(succeeded)

    async def _stream(self, path: str, body: bytes, headers: dict[str, str], decision: Decision,
                      lease: Lease) -> Attempt:
        replica, handed_over = decision.replica, False
        upstream: httpx.Response | None = None
        try:
            request = self.client.build_request("POST", f"{replica.url}{path}", content=body, headers=headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except httpx.HTTPError as error:
                return self._connection_failed(decision, error)
            if upstream.status_code != 200:
                content = await self._read_and_close(upstream)
                refused = self._refused(decision, upstream, content)
                return refused if refused is not None else Attempt(self._relayed(upstream, content), retry=False)
            chunks = upstream.aiter_raw()
            try:
                first = await chunks.__anext__()
            except (httpx.HTTPError, StopAsyncIteration) as error:
                return self._connection_failed(decision, error)
            handed_over = True
            # The background task runs even when the client leaves before the body starts, which would
            # leave _relay's own cleanup unrun.
            return Attempt(StreamingResponse(
                self._relay(first, chunks, upstream, decision, lease), status_code=200,
                headers=self._returned_headers(upstream), background=BackgroundTask(self._close, upstream, lease),
            ), retry=False)
        finally:  # also on cancellation (the client left while waiting): the replica's stream is closed
            if not handed_over:
                lease.finish(succeeded=False)
                if upstream is not None:
                    await upstream.aclose()

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response,
                     decision: Decision, lease: Lease) -> AsyncIterator[bytes]:
        """The replica's stream, as it comes. Closing it (the client went away) closes the replica's stream,
        which aborts the request there."""
        completed = False
        try:
            lease.first_output()
            chunk = first
            while True:
                lease.add_output_tokens(chunk.count(SSE_EVENT))
                self._observe_usage(decision, chunk)
                yield chunk
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            completed = True
            self.router.record_success(decision.replica)
        except httpx.HTTPError as error:
            logger.warning("replica %s failed mid-stream: %s", decision.replica.url, error)
            self.router.record_failure(decision.replica)
            yield self._sse_error(502, f"the replica failed while streaming: {type(error).__name__}")
        finally:
            lease.finish(succeeded=completed)
            await upstream.aclose()

    @staticmethod
    async def _close(upstream: httpx.Response, lease: Lease) -> None:
        lease.finish(succeeded=False)  # a no-op after a relay that ran to its end
        await upstream.aclose()

    # --- outcomes ----------------------------------------------------------------------------------

    def _connection_failed(self, decision: Decision, error: BaseException) -> Attempt:
        logger.warning("replica %s: %s", decision.replica.url, type(error).__name__)
        self.router.record_failure(decision.replica)
        self.router.record_retry(decision.replica, "connection")
        return Attempt(_error(502, f"no replica answered (last: {type(error).__name__})"), retry=True)

    def _refused(self, decision: Decision, upstream: httpx.Response, content: bytes) -> Attempt | None:
        """A 5xx (a failure) or a 429 (saturation): another replica may take the request. None otherwise;
        a 4xx is the client's fault, and proves the replica alive."""
        replica, status = decision.replica, upstream.status_code
        if status >= 500:
            self.router.record_failure(replica)
            self.router.record_retry(replica, "5xx")
        elif status == 429:
            self.router.record_saturated(replica, _retry_after(upstream))
            self.router.record_retry(replica, "429")
        else:
            self.router.record_success(replica)
            return None
        return Attempt(self._relayed(upstream, content), retry=True)

    def _observe_usage(self, decision: Decision, content: bytes) -> None:
        match = CACHED_TOKENS.search(content)
        if match is not None:
            self.router.observe_cached_tokens(decision, int(match.group(1)))

    async def _read_and_close(self, upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError:
            return b""
        finally:
            await upstream.aclose()

    def _relayed(self, upstream: httpx.Response, content: bytes) -> Response:
        return Response(content, status_code=upstream.status_code, headers=self._returned_headers(upstream))

    @staticmethod
    def _returned_headers(upstream: httpx.Response) -> dict[str, str]:
        return {name: upstream.headers[name] for name in RETURNED_HEADERS if name in upstream.headers}

    @staticmethod
    def _sse_error(status: int, message: str) -> bytes:
        return b"data: " + json.dumps(OpenAIError(status, message).body()).encode() + b"\n\ndata: [DONE]\n\n"


# --- the app ---------------------------------------------------------------------------------------


def build_router_app(router: Router, reader: PromptReader, client: httpx.AsyncClient,
                     limits: ServerLimits | None = None, events_topic: str = "") -> FastAPI:
    limits = limits or ServerLimits()
    forwarder = Forwarder(router, client, random.Random(router.config.seed))
    decoder = JsonDecoder()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(poll_forever(router, client))]
        tasks += [asyncio.create_task(subscribe_forever(router, r, r.events_endpoint, events_topic))
                  for r in router.replicas if r.events_endpoint is not None]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await client.aclose()

    app = FastAPI(title="pagoda router", version=pagoda.__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Unknown routes, wrong methods, invalid Unicode in a body: OpenAI's error shape too."""
        return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=dict(error.headers) if error.headers else None)

    @app.get("/health")
    async def health() -> Response:
        now = router.clock()
        return Response(status_code=200 if any(r.routable(now) for r in router.replicas) else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """Answers whenever the process serves HTTP: the liveness probe's (/health is about the replicas)."""
        return {"version": pagoda.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await _first_answer(router, client, "GET", "/v1/models", _forwarded(raw))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await _first_answer(router, client, "POST", "/tokenize", _forwarded(raw), await raw.body())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await _first_answer(router, client, "POST", "/detokenize", _forwarded(raw), await raw.body())

    async def proxied(raw: Request, path: str, read: Callable[[dict[str, Any]], Awaitable[RoutedPrompt]]) -> Response:
        body = await raw.body()
        try:
            parsed = await decoder.decode(body)
        except ValueError:
            raise OpenAIError(400, "the request body is not valid JSON") from None
        if not isinstance(parsed, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        prompt = await read(parsed)
        work = forwarder.dispatch(path, body, _forwarded(raw), prompt, stream=parsed.get("stream") is True)
        return await _unless_client_leaves(raw, work)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxied(raw, "/v1/completions", reader.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await proxied(raw, "/v1/chat/completions", reader.chat)

    return app


def _forwarded(raw: Request) -> dict[str, str]:
    return {name: raw.headers[name] for name in FORWARDED_HEADERS if name in raw.headers}


async def _first_answer(router: Router, client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str],
                        body: bytes | None = None) -> Response:
    """A request about the model, not a generation (they serve the same one): the first replica up that answers
    it without a 5xx answers it."""
    now = router.clock()
    for replica in [r for r in router.replicas if r.routable(now)]:
        try:
            upstream = await client.request(method, f"{replica.url}{path}", headers=headers, content=body)
        except httpx.HTTPError:
            continue
        if upstream.status_code < 500:
            return Response(upstream.content, status_code=upstream.status_code,
                            headers=Forwarder._returned_headers(upstream))
    return _error(503, "no replica is available")


async def _unless_client_leaves(raw: Request, work: Awaitable[Response]) -> Response:
    """The routed work, raced against the client's disconnect (which Starlette does not watch before a response
    starts): a client that leaves cancels its request on the replica and frees its load at the router."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_client_gone(raw))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


async def _client_gone(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
