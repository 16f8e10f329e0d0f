"""A bad request is not a bad replica, and the router checks keys.

What each outcome of an attempt means (pure), what the Router does with it on a fake clock (the breaker, the
last replica up), the same through the HTTP side against fake replicas (httpx.MockTransport), and the router's
API keys, the key it sends the replicas, and its OpenAPI pages (off unless asked).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest
from test_router_proxy import BODY, COMPLETION, Fleet, Handler, answer, metric, refuse, sse, stream

from pagoda.api_keys import ApiKeys
from pagoda.cli import build_parser
from pagoda.router.app import build_router_app
from pagoda.router.cli import REPLICA_API_KEY_ENV_VAR, replica_api_key
from pagoda.router.config import RouterConfig
from pagoda.router.core import NoReplicaAvailable, Router
from pagoda.router.faults import Outcome, classify_answer
from pagoda.router.policies import RoutedPrompt
from pagoda.router.poller import poll_replica
from pagoda.router.tokens import LoadOnlyReader
from pagoda.wire import ERROR_SCOPE_HEADER

pytestmark = pytest.mark.timeout(60)

REPLICAS = ("http://a", "http://b")
POISON = {"error": {"message": "the grammar cannot be compiled", "type": "InternalServerError", "param": None,
                    "code": 500}}
MARKED = {ERROR_SCOPE_HEADER: "request"}


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "headers", "outcome"), [
    (200, {}, Outcome.ANSWERED),
    (400, {}, Outcome.ANSWERED),
    (404, {}, Outcome.ANSWERED),
    (413, {}, Outcome.ANSWERED),
    (429, {}, Outcome.SATURATED),
    (500, MARKED, Outcome.REQUEST_FAULT),
    (500, {ERROR_SCOPE_HEADER: " Request "}, Outcome.REQUEST_FAULT),
    (504, MARKED, Outcome.REQUEST_FAULT),
    (500, {}, Outcome.REPLICA_ERROR),
    (500, {ERROR_SCOPE_HEADER: "replica"}, Outcome.REPLICA_ERROR),
    (502, {}, Outcome.REPLICA_ERROR),
    (503, {}, Outcome.REPLICA_ERROR),
    (504, {}, Outcome.REPLICA_ERROR),
])
def test_each_answer_is_classified(status, headers, outcome):
    assert classify_answer(status, httpx.Headers(headers)) is outcome
    assert outcome.retried == (outcome in (Outcome.SATURATED, Outcome.REPLICA_ERROR))
    assert outcome.is_failure == (outcome is Outcome.REPLICA_ERROR)


def test_only_a_replica_that_does_not_answer_may_be_ejected_as_the_last_one_up():
    assert {o for o in Outcome if o.may_eject_last_replica} == {Outcome.CONNECTION, Outcome.TIMEOUT}
    assert {o for o in Outcome if o.is_failure} == {Outcome.REPLICA_ERROR, Outcome.CONNECTION, Outcome.TIMEOUT}


# --------------------------------------------------------------------------------------------------
# The Router on a fake clock
# --------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_clock_router(num_replicas: int = 2, **config) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router([f"http://replica-{i}" for i in range(num_replicas)],
                    RouterConfig(policy="round_robin", **config), clock=clock)
    for replica in router.replicas:
        router.set_health(replica, True)
    return router, clock


def test_a_request_fault_neither_counts_nor_resets_the_breaker():
    router, clock = fake_clock_router(breaker_failures=3)
    replica = router.replicas[0]
    router.record_outcome(replica, Outcome.REPLICA_ERROR)
    for _ in range(10):
        router.record_outcome(replica, Outcome.REQUEST_FAULT)
    assert replica.breaker.consecutive_failures == 1
    router.record_outcome(replica, Outcome.ANSWERED)
    assert replica.breaker.consecutive_failures == 0


@pytest.mark.parametrize("failure", [Outcome.REPLICA_ERROR, Outcome.CONNECTION, Outcome.TIMEOUT])
def test_failures_eject_a_replica_while_another_is_up(failure):
    router, clock = fake_clock_router(breaker_failures=2, breaker_cooldown_s=5.0)
    flaky, other = router.replicas
    router.record_outcome(flaky, failure)
    assert flaky.routable(clock.now)
    router.record_outcome(flaky, failure)
    assert not flaky.routable(clock.now) and other.routable(clock.now)
    assert router.metrics.ejections.labels(flaky.url)._value.get() == 1


def test_error_answers_never_eject_the_last_replica_up_but_silence_does():
    router, clock = fake_clock_router(breaker_failures=2, breaker_cooldown_s=5.0)
    first, last = router.replicas
    for _ in range(2):
        router.record_outcome(first, Outcome.CONNECTION)
    assert not first.routable(clock.now)
    for _ in range(10):  # it answers, if only with errors: still better than the router's 503 for everyone
        router.record_outcome(last, Outcome.REPLICA_ERROR)
    assert last.routable(clock.now)
    assert router.choose(RoutedPrompt(None)).replica is last
    clock.now = 5.0  # the first is back: one more error answer ejects the last, now that another is up
    assert first.routable(clock.now)
    router.record_outcome(last, Outcome.REPLICA_ERROR)
    assert not last.routable(clock.now)
    assert router.metrics.ejections.labels(last.url)._value.get() == 1
    router.record_outcome(first, Outcome.TIMEOUT)  # silence ejects even the last replica up
    assert not first.routable(clock.now)
    with pytest.raises(NoReplicaAvailable) as refused:
        router.choose(RoutedPrompt(None))
    assert refused.value.status == 503


def test_a_replica_marked_down_by_its_health_check_is_not_up_for_the_last_replica_rule():
    router, clock = fake_clock_router(breaker_failures=1)
    down, last = router.replicas
    router.set_health(down, False)
    router.record_outcome(last, Outcome.REPLICA_ERROR)
    assert last.routable(clock.now)


# --------------------------------------------------------------------------------------------------
# Through the HTTP side, against fake replicas
# --------------------------------------------------------------------------------------------------


def run(fleet: Callable[[httpx.Request], httpx.Response], requests, api_keys: ApiKeys | None = None,
        replica_api_key: str | None = None, enable_docs: bool = False, **config) -> None:
    """The router over fake replicas a and b (round robin: a first), `requests` run against it in process."""
    router = Router(REPLICAS, RouterConfig(policy="round_robin", retry_backoff_s=0.001, **config))
    for replica in router.replicas:
        router.set_health(replica, True)
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet))
    app = build_router_app(router, LoadOnlyReader(), client, api_keys=api_keys, replica_api_key=replica_api_key,
                           enable_docs=enable_docs)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as http:
            await requests(http, router, client)
        assert all(r.active_requests == 0 and r.active_tokens == 0 for r in router.replicas), "load leaked"

    asyncio.run(main())


def poisoned(poison: httpx.Response) -> Handler:
    """A replica that answers `poison` to requests asking for a grammar and serves the rest."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "response_format" in body:
            return httpx.Response(poison.status_code, content=poison.content, headers=poison.headers)
        if body.get("stream"):
            return stream(sse({"choices": [{"index": 0, "text": "hi"}]}))(request)
        return httpx.Response(200, json=COMPLETION)

    return handler


@pytest.mark.parametrize("poison", [
    httpx.Response(400, json={"error": {"message": "bad field", "type": "BadRequestError", "param": "x",
                                        "code": 400}}),
    httpx.Response(500, json=POISON, headers=MARKED),
], ids=["4xx", "marked-5xx"])
def test_the_requests_own_error_goes_back_as_it_came_and_ejects_nothing(poison):
    fleet = Fleet(a=poisoned(poison), b=poisoned(poison))
    bad = {**BODY, "response_format": {"type": "json_object"}}

    async def requests(http, router, _client):
        for _ in range(10):  # far past --breaker-failures
            response = await http.post("/v1/completions", json=bad)
            assert response.status_code == poison.status_code and response.content == poison.content
            if poison.status_code >= 500:
                assert response.headers[ERROR_SCOPE_HEADER] == "request", "a router in front sees the scope too"
        assert len(fleet.calls) == 10, "none retried"
        assert metric(router, "pagoda_router_retries_total") == 0
        assert metric(router, "pagoda_router_ejections_total") == 0
        assert all(r.breaker.consecutive_failures == 0 for r in router.replicas)
        for streamed in (False, True):
            response = await http.post("/v1/completions", json={**BODY, "stream": streamed})
            assert response.status_code == 200
        assert (await http.get("/health")).status_code == 200

    run(fleet, requests, breaker_failures=2)


def test_an_unmarked_500_is_a_replica_failure_retried_elsewhere():
    fleet = Fleet(a=answer(500, POISON), b=answer())

    async def requests(http, router, _client):
        response = await http.post("/v1/completions", json=BODY)
        assert response.status_code == 200 and fleet.calls == ["a", "b"]
        assert router.replicas[0].breaker.consecutive_failures == 1
        assert metric(router, "pagoda_router_retries_total", replica="http://a", reason="5xx") == 1

    run(fleet, requests)


def test_a_timeout_is_a_failure_retried_elsewhere():
    fleet = Fleet(a=refuse(httpx.ReadTimeout), b=answer())

    async def requests(http, router, _client):
        assert (await http.post("/v1/completions", json=BODY)).status_code == 200
        assert router.replicas[0].breaker.consecutive_failures == 1
        assert metric(router, "pagoda_router_retries_total", replica="http://a", reason="timeout") == 1

    run(fleet, requests)


def test_replicas_answering_unmarked_500s_leave_one_up_and_its_answers_reach_the_client():
    fleet = Fleet(a=answer(500, POISON), b=answer(500, POISON))

    async def requests(http, router, _client):
        for _ in range(6):
            response = await http.post("/v1/completions", json=BODY)
            assert response.status_code == 500 and response.json() == POISON, "the replica's answer, not a 503"
        assert metric(router, "pagoda_router_ejections_total") == 1
        assert sum(metric(router, "pagoda_router_replica_up", replica=url) for url in REPLICAS) == 1
        assert (await http.get("/health")).status_code == 200

    run(fleet, requests, breaker_failures=1, breaker_cooldown_s=60.0)


def test_replicas_that_do_not_answer_are_all_ejected():
    fleet = Fleet(a=refuse(httpx.ConnectError), b=refuse(httpx.ConnectError))

    async def requests(http, router, _client):
        assert (await http.post("/v1/completions", json=BODY)).status_code == 502
        assert metric(router, "pagoda_router_ejections_total") == 2
        assert (await http.get("/health")).status_code == 503
        assert (await http.post("/v1/completions", json=BODY)).status_code == 503

    run(fleet, requests, breaker_failures=1, breaker_cooldown_s=60.0)


# --------------------------------------------------------------------------------------------------
# Keys and docs
# --------------------------------------------------------------------------------------------------


class Recording:
    """Fake replicas that answer every call and keep each one's Authorization header."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": []})
        if request.content and json.loads(request.content).get("stream"):
            return stream(sse({"choices": [{"index": 0, "text": "hi"}]}))(request)
        return httpx.Response(200, json=COMPLETION)


KEYS = ApiKeys.gather(["router-key", "second-key"], environ={})


def test_without_a_valid_key_the_router_answers_401_and_sends_nothing():
    fleet = Recording()

    async def requests(http, router, _client):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "router-key"}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/nowhere")):
                response = await http.request(method, path, json=BODY, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                error = response.json()["error"]
                assert error["type"] == "AuthenticationError" and error["code"] == 401
                assert response.headers["www-authenticate"] == "Bearer"
        assert fleet.seen == []
        for path in ("/health", "/version", "/metrics"):  # probes and scrapes carry no key
            assert (await http.get(path)).status_code == 200, path

    run(fleet, requests, api_keys=KEYS)


def test_a_valid_key_passes_and_is_forwarded_to_the_replica():
    fleet = Recording()

    async def requests(http, router, _client):
        for key in ("router-key", "second-key"):
            response = await http.post("/v1/completions", json=BODY, headers={"Authorization": f"bearer {key}"})
            assert response.status_code == 200 and response.json() == COMPLETION
        assert [auth for _, auth in fleet.seen] == ["bearer router-key", "bearer second-key"]

    run(fleet, requests, api_keys=KEYS)


def test_a_replica_key_replaces_the_clients_on_requests_and_polls():
    fleet = Recording()

    async def requests(http, router, client):
        headers = {"Authorization": "Bearer router-key"}
        assert (await http.post("/v1/completions", json=BODY, headers=headers)).status_code == 200
        assert (await http.post("/v1/completions", json={**BODY, "stream": True}, headers=headers)).status_code == 200
        assert (await http.get("/v1/models", headers=headers)).status_code == 200
        await poll_replica(router, router.replicas[0], client)
        assert {path for path, _ in fleet.seen} == {"/v1/completions", "/v1/models", "/health", "/metrics"}
        assert {auth for _, auth in fleet.seen} == {"Bearer replica-key"}, "the client's key never reaches a replica"

    run(fleet, requests, api_keys=KEYS, replica_api_key="replica-key")


@pytest.mark.parametrize("api_keys", [None, KEYS], ids=["open", "keyed"])
def test_the_openapi_pages_are_served_only_when_enabled(api_keys):
    headers = {"Authorization": "Bearer router-key"}

    async def hidden(http, _router, _client):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await http.get(path, headers=headers)).status_code == 404, path
            if api_keys is not None:
                assert (await http.get(path)).status_code == 401, "no route map without a key"

    async def shown(http, _router, _client):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await http.get(path, headers=headers)).status_code == 200, path
            if api_keys is not None:
                assert (await http.get(path)).status_code == 401, path
        assert "/v1/chat/completions" in (await http.get("/openapi.json", headers=headers)).json()["paths"]

    run(Recording(), hidden, api_keys=api_keys)
    run(Recording(), shown, api_keys=api_keys, enable_docs=True)


def test_route_takes_keys_as_serve_does(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# router keys\nfile-key\n", encoding="utf-8")
    monkeypatch.setenv("PAGODA_API_KEY", "env-key")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    args = build_parser().parse_args(["route", "--replica", "http://a", "--api-key", "one", "--api-key", "two",
                                      "--api-key-file", str(key_file), "--enable-docs"])
    keys = ApiKeys.from_args(args)
    for key in ("one", "two", "file-key", "env-key", "vllm-key"):
        assert keys.accepts(f"Bearer {key}"), key
    assert not keys.accepts("Bearer three") and args.enable_docs
    monkeypatch.delenv("PAGODA_API_KEY")
    monkeypatch.delenv("VLLM_API_KEY")
    plain = build_parser().parse_args(["route", "--replica", "http://a"])
    assert not ApiKeys.from_args(plain).enabled and not plain.enable_docs
    assert replica_api_key(None, {}) is None
    assert replica_api_key(None, {REPLICA_API_KEY_ENV_VAR: "from-env"}) == "from-env"
    assert replica_api_key("from-flag", {REPLICA_API_KEY_ENV_VAR: "from-env"}) == "from-flag"
    with pytest.raises(ValueError):
        replica_api_key(" padded ", {})
    with pytest.raises(ValueError):
        ApiKeys.from_args(build_parser().parse_args(["route", "--replica", "http://a", "--guard-metrics"]))
