"""`pagoda route`'s sending side: `Forwarder` sends a routed request to a replica and relays its answer.

Every request is routed by `Router`, sent with `Forwarder`, and retried on another replica (after a jittered
backoff) when its replica fails (no answer, a replica-wide 5xx) or refuses it (429), but only while nothing
has reached the client: a stream is handed to the client once the replica's first chunk is in, and a replica
failing after that ends the stream with an SSE error event. What is the request's own fault (a 4xx, a 5xx
marked request-scoped) goes back as it came (`router/faults.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagoda.router.core import Decision, Lease, NoReplicaAvailable, Router
from pagoda.router.faults import Outcome, classify_answer
from pagoda.router.policies import RoutedPrompt
from pagoda.router.replica import Replica
from pagoda.router.tenancy import TenantMeter
from pagoda.tenant_door import RATE_LIMIT_HEADERS
from pagoda.wire import ERROR_SCOPE_HEADER, OpenAIError

logger = logging.getLogger("pagoda.route")

RETURNED_HEADERS = ("content-type", "retry-after", "x-request-id", ERROR_SCOPE_HEADER, *RATE_LIMIT_HEADERS)
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-f]{32})"')  # server/responses.py's ids
SSE_EVENT = b"data:"


@dataclass(frozen=True)
class Attempt:
    """One try on one replica: the response to give the client, and whether another replica may be tried."""

    response: Response
    retry: bool


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The router's own answers, in OpenAI's error shape."""
    return JSONResponse(OpenAIError(status, message).body(), status_code=status, headers=headers)


def _error(status: int, message: str, retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(retry_after_s)))} if retry_after_s is not None else None
    return error_response(status, message, headers)


def failure_of(error: BaseException) -> Outcome:
    """What an exception instead of an answer means: a timeout, or a connection that failed or closed."""
    return Outcome.TIMEOUT if isinstance(error, httpx.TimeoutException) else Outcome.CONNECTION


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
                       stream: bool, pinned: Replica | None = None, meter: TenantMeter | None = None) -> Response:
        """Tries replicas until one answers (or none is left): the answer, or the last failure's. pinned: the
        only replica that may answer (it holds the response the request continues). meter: the request's tenant,
        charged for the tokens the answer shows."""
        tried: list[Replica] = []
        last: Response | None = None
        for attempt in range(self.router.config.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            try:
                decision = self.router.choose(prompt, exclude=tried, pinned=pinned)
            except NoReplicaAvailable as refusal:
                return last if last is not None else _error(refusal.status, str(refusal), refusal.retry_after_s)
            tried.append(decision.replica)
            lease = self.router.begin(decision)
            send = self._stream if stream else self._whole
            outcome = await send(path, body, headers, decision, lease, meter)
            if not outcome.retry:
                return outcome.response
            last = outcome.response
        assert last is not None
        return last

    def _backoff(self, attempt: int) -> float:
        """Exponential, times a random factor in [0.5, 1.5): retries of many requests do not arrive together."""
        return float(self.router.config.retry_backoff_s * 2.0 ** (attempt - 1) * (0.5 + self.rng.random()))

    async def _whole(self, path: str, body: bytes, headers: dict[str, str], decision: Decision,
                     lease: Lease, meter: TenantMeter | None) -> Attempt:
        replica, succeeded = decision.replica, False
        try:
            try:
                upstream = await self.client.post(f"{replica.url}{path}", content=body, headers=headers)
            except httpx.HTTPError as error:
                return self._no_answer(decision, error)
            refused = self._refused(decision, upstream, upstream.content)
            if refused is not None:
                return refused
            succeeded = upstream.status_code < 400
            if upstream.status_code == 200:
                self._observe_usage(decision, upstream.content)
                if meter is not None:
                    meter.observe(upstream.content, streamed=False)
            return Attempt(self._relayed(upstream, upstream.content), retry=False)
        finally:  # also on cancellation: the client went away
            lease.finish(succeeded)

    async def _stream(self, path: str, body: bytes, headers: dict[str, str], decision: Decision,
                      lease: Lease, meter: TenantMeter | None) -> Attempt:
        replica, handed_over = decision.replica, False
        upstream: httpx.Response | None = None
        try:
            request = self.client.build_request("POST", f"{replica.url}{path}", content=body, headers=headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except httpx.HTTPError as error:
                return self._no_answer(decision, error)
            if upstream.status_code != 200:
                content = await self._read_and_close(upstream)
                refused = self._refused(decision, upstream, content)
                return refused if refused is not None else Attempt(self._relayed(upstream, content), retry=False)
            chunks = upstream.aiter_raw()
            try:
                first = await chunks.__anext__()
            except (httpx.HTTPError, StopAsyncIteration) as error:
                return self._no_answer(decision, error)
            handed_over = True
            # The background task runs even when the client leaves before the body starts, which would
            # leave _relay's own cleanup unrun.
            return Attempt(StreamingResponse(
                self._relay(first, chunks, upstream, decision, lease, meter), status_code=200,
                headers=self._returned_headers(upstream), background=BackgroundTask(self._close, upstream, lease),
            ), retry=False)
        finally:  # also on cancellation (the client left while waiting): the replica's stream is closed
            if not handed_over:
                lease.finish(succeeded=False)
                if upstream is not None:
                    await upstream.aclose()

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response,
                     decision: Decision, lease: Lease, meter: TenantMeter | None) -> AsyncIterator[bytes]:
        """The replica's stream, as it comes. Closing it (the client went away) closes the replica's stream,
        which aborts the request there."""
        completed = False
        try:
            lease.first_output()
            chunk = first
            while True:
                lease.add_output_tokens(chunk.count(SSE_EVENT))
                self._observe_usage(decision, chunk)
                if meter is not None:
                    meter.observe(chunk, streamed=True)
                yield chunk
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            completed = True
            self.router.record_success(decision.replica)
        except httpx.HTTPError as error:
            logger.warning("replica %s failed mid-stream: %s", decision.replica.url, type(error).__name__)
            self.router.record_failure(decision.replica, failure_of(error))
            yield self._sse_error(502, f"the replica failed while streaming: {type(error).__name__}")
        finally:
            lease.finish(succeeded=completed)
            await upstream.aclose()

    @staticmethod
    async def _close(upstream: httpx.Response, lease: Lease) -> None:
        lease.finish(succeeded=False)  # a no-op after a relay that ran to its end
        await upstream.aclose()

    # --- outcomes ----------------------------------------------------------------------------------

    def _no_answer(self, decision: Decision, error: BaseException) -> Attempt:
        """No answer (StopAsyncIteration: a stream that closed before its first chunk)."""
        logger.warning("replica %s: %s", decision.replica.url, type(error).__name__)
        outcome = failure_of(error)
        self.router.record_outcome(decision.replica, outcome)
        self.router.record_retry(decision.replica, outcome.value)
        return Attempt(_error(502, f"no replica answered (last: {type(error).__name__})"), retry=True)

    def _refused(self, decision: Decision, upstream: httpx.Response, content: bytes) -> Attempt | None:
        """An answer another replica may take instead (a replica-wide 5xx, a 429), recorded; None for one that
        goes to the client as it is (a success, the client's error, a 5xx the replica marked as the request's
        own)."""
        replica, outcome = decision.replica, classify_answer(upstream.status_code, upstream.headers)
        self.router.record_outcome(replica, outcome, _retry_after(upstream))
        if not outcome.retried:
            return None
        self.router.record_retry(replica, outcome.value)
        return Attempt(self._relayed(upstream, content), retry=True)

    def _observe_usage(self, decision: Decision, content: bytes) -> None:
        """What an answer tells the router: the replica's cached tokens, and the id of a Responses API
        response it now stores (a whole answer's, or a stream's, whose first event carries it)."""
        match = CACHED_TOKENS.search(content)
        if match is not None:
            self.router.observe_cached_tokens(decision, int(match.group(1)))
        stored = RESPONSE_ID.search(content)
        if stored is not None:
            self.router.remember_response(stored.group(1).decode(), decision.replica)

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
