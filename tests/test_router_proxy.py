"""The router's HTTP side against fake replicas (httpx.MockTransport): retries before the first byte, SSE error
events after it, what counts toward the circuit breaker, 429 with Retry-After, OpenAI-shaped errors, and the
router's load returning to zero on every path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.router.app import build_router_app
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.tokens import LoadOnlyReader

pytestmark = pytest.mark.timeout(60)

REPLICAS = ("http://a", "http://b")
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}


def sse(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def chunks_then(chunks: list[bytes], error: Exception | None = None) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    if error is not None:
        raise error


Handler = Callable[[httpx.Request], httpx.Response]


class Fleet:
    """Fake replicas: a handler per replica host; records which replica got which request."""

    def __init__(self, **handlers: Handler) -> None:
        self.handlers = handlers
        self.calls: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.host)
        return self.handlers[request.url.host](request)


def refuse(exception: type[Exception]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exception("refused", request=request)

    return handler


def answer(status: int = 200, body: object = COMPLETION, headers: dict | None = None) -> Handler:
    return lambda request: httpx.Response(status, json=body, headers=headers)


def stream(chunks: list[bytes], error: Exception | None = None) -> Handler:
    return lambda request: httpx.Response(200, content=chunks_then(chunks, error),
                                          headers={"content-type": "text/event-stream"})


def run(fleet: Fleet, requests: Callable[[httpx.AsyncClient, Router], object], **config) -> None:
    """Builds the router over the fleet (round robin: a before b) and runs `requests` against it."""
    router = Router(REPLICAS, RouterConfig(policy="round_robin", retry_backoff_s=0.001, **config))
    for replica in router.replicas:  # as the poller's first health check would find them
        router.set_health(replica, True)
    app = build_router_app(router, LoadOnlyReader(), httpx.AsyncClient(transport=httpx.MockTransport(fleet)))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as client:
            await requests(client, router)
        assert all(r.active_requests == 0 and r.active_tokens == 0 for r in router.replicas), "load leaked"

    asyncio.run(main())


def metric(router: Router, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(router.metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    return error


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [refuse(httpx.ConnectError), answer(503, {"error": {"message": "down"}})],
                         ids=["connection", "5xx"])
def test_a_failed_replica_is_retried_on_another_and_counted(failure):
    fleet = Fleet(a=failure, b=answer())

    async def requests(client, router):
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 200 and response.json() == COMPLETION
        assert fleet.calls == ["a", "b"]
        assert router.replicas[0].breaker.consecutive_failures == 1
        assert metric(router, "pagoda_router_retries_total", replica="http://a") == 1

    run(fleet, requests)


def test_a_client_error_is_passed_through_and_never_counts_as_a_failure():
    bad = {"error": {"message": "max_tokens too large", "type": "BadRequestError", "param": None, "code": 400}}
    fleet = Fleet(a=answer(400, bad), b=answer(400, bad))

    async def requests(client, router):
        for _ in range(6):
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 400 and response.json() == bad
        assert len(fleet.calls) == 6, "no retries"
        assert all(r.breaker.consecutive_failures == 0 for r in router.replicas)

    run(fleet, requests, breaker_failures=2)


def test_repeated_failures_eject_a_replica():
    fleet = Fleet(a=refuse(httpx.ConnectError), b=answer())

    async def requests(client, router):
        for _ in range(4):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert fleet.calls.count("a") == 2, "ejected after its second failure"
        assert metric(router, "pagoda_router_ejections_total", replica="http://a") == 1
        assert metric(router, "pagoda_router_replica_up", replica="http://a") == 0

    run(fleet, requests, breaker_failures=2, breaker_cooldown_s=60.0)


def test_when_every_replica_refuses_429_the_client_gets_429_with_retry_after():
    busy = {"error": {"message": "busy", "type": "RateLimitError", "param": None, "code": 429}}
    fleet = Fleet(a=answer(429, busy, {"Retry-After": "7"}), b=answer(429, busy, {"Retry-After": "9"}))

    async def requests(client, router):
        first = await client.post("/v1/completions", json=BODY)
        assert first.status_code == 429 and first.headers["retry-after"] in ("7", "9")
        assert fleet.calls == ["a", "b"]
        second = await client.post("/v1/completions", json=BODY)  # the router knows: nobody is asked
        assert_openai_error(second, 429)
        assert second.headers["retry-after"] == "7"
        assert fleet.calls == ["a", "b"]
        assert all(r.breaker.consecutive_failures == 0 for r in router.replicas), "a 429 is not a failure"

    run(fleet, requests)


def test_a_stream_that_fails_before_its_first_byte_is_retried():
    chunks = sse({"choices": [{"index": 0, "text": "hi"}]})
    fleet = Fleet(a=stream([], httpx.ReadError("reset")), b=stream(chunks))

    async def requests(client, router):
        response = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert response.status_code == 200 and response.content == b"".join(chunks)
        assert fleet.calls == ["a", "b"]

    run(fleet, requests)


def test_a_stream_that_fails_after_its_first_byte_ends_with_an_sse_error_event():
    first = sse({"choices": [{"index": 0, "text": "hi"}]})[0]
    fleet = Fleet(a=stream([first], httpx.ReadError("reset")), b=answer())

    async def requests(client, router):
        response = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e]
        assert events[0] == first.decode().strip()
        error = json.loads(events[1].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "streaming" in error["message"]
        assert events[2] == "data: [DONE]"
        assert fleet.calls == ["a"], "no retry once the client has bytes"
        assert router.replicas[0].breaker.consecutive_failures == 1

    run(fleet, requests)


def test_bad_bodies_are_refused_by_the_router_in_openai_shape():
    fleet = Fleet(a=answer(), b=answer())

    async def requests(client, router):
        assert_openai_error(await client.post("/v1/completions", content=b"{not json"), 400)
        assert_openai_error(await client.post("/v1/chat/completions", json=[1, 2]), 400)
        assert_openai_error(await client.post("/v1/completions", content=b'{"prompt": "\\ud800"}'), 400)
        assert_openai_error(await client.get("/v1/nowhere"), 404)
        assert_openai_error(await client.post("/v1/completions", content=b"x" * (9 << 20)), 413)
        assert fleet.calls == []

    run(fleet, requests)


def test_health_models_tokenize_and_metrics():
    models = {"object": "list", "data": [{"id": "m", "object": "model"}]}

    def replica_b(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            assert json.loads(request.content) == {"prompt": "hi"}
            return httpx.Response(200, json={"tokens": [7, 8], "count": 2})
        return httpx.Response(200, json=models if request.url.path == "/v1/models" else COMPLETION)

    fleet = Fleet(a=refuse(httpx.ConnectError), b=replica_b)

    async def requests(client, router):
        assert (await client.get("/health")).status_code == 200
        response = await client.get("/v1/models")
        assert response.status_code == 200 and response.json() == models
        response = await client.post("/tokenize", json={"prompt": "hi"})
        assert response.status_code == 200 and response.json()["tokens"] == [7, 8]
        await client.post("/v1/completions", json=BODY)
        text = (await client.get("/metrics")).text
        assert 'pagoda_router_requests_total{replica="http://b"} 1.0' in text
        assert 'pagoda_router_prompt_tokens_total{replica="http://b"} 3.0' in text
        for replica in router.replicas:
            router.set_health(replica, False)
        assert (await client.get("/health")).status_code == 503
        assert_openai_error(await client.post("/v1/completions", json=BODY), 503)

    run(fleet, requests)


RESPONSE_ID = "resp_" + "0" * 32
RESPONSE = {"id": RESPONSE_ID, "object": "response", "output": [], "usage": None}


def test_a_continued_response_is_pinned_to_its_replica_and_fails_clearly_when_it_is_down():
    fleet = Fleet(a=answer(body=RESPONSE), b=answer(body={**RESPONSE, "id": "resp_" + "1" * 32}))

    async def requests(client: httpx.AsyncClient, router: Router) -> None:
        first = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert first.json()["id"] == RESPONSE_ID and fleet.calls == ["a"]
        body = {"model": "m", "input": "more", "previous_response_id": RESPONSE_ID}
        for _ in range(3):  # round robin would alternate; the continuation stays on a
            assert (await client.post("/v1/responses", json=body)).status_code == 200
        assert fleet.calls == ["a"] * 4
        assert (await client.get(f"/v1/responses/{RESPONSE_ID}")).json()["id"] == RESPONSE_ID
        assert fleet.calls[-1] == "a"
        assert_openai_error(await client.get("/v1/responses/resp_unknown"), 404)
        fleet.handlers["a"] = refuse(httpx.ConnectError)
        error = assert_openai_error(await client.post("/v1/responses", json=body), 502)
        assert "no replica answered" in error["message"]
        assert fleet.calls[-1] == "a", "never sent to a replica that lacks the conversation"
        router.set_health(router.replicas[0], False)
        error = assert_openai_error(await client.post("/v1/responses", json=body), 503)
        assert "http://a" in error["message"]

    run(fleet, requests)


EMBEDDING = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
             "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3}}


def test_embeddings_are_forwarded_unchanged_and_retried_like_generations():
    seen: list[bytes] = []

    def embed(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return httpx.Response(200, json=EMBEDDING)

    fleet = Fleet(a=refuse(httpx.ConnectError), b=embed)

    async def requests(client: httpx.AsyncClient, router: Router) -> None:
        body = {"model": "m", "input": [[1, 2, 3]], "encoding_format": "float"}
        answer = await client.post("/v1/embeddings", json=body)
        assert answer.status_code == 200 and answer.json() == EMBEDDING
        assert fleet.calls == ["a", "b"] and [json.loads(s) for s in seen] == [body]
        assert_openai_error(await client.post("/v1/embeddings", content=b"[1"), 400)

    run(fleet, requests)
