"""`pagoda route` with tenants and LoRA adapters: over two real replicas (one serving an adapter), a request
naming the adapter goes to the replica that lists it in /v1/models, the client's key and the gateway's header
reach the replicas unchanged (even with --replica-api-key), and the router admits against one set of buckets.
Against fake replicas: a replica's tenant 429 is relayed with its headers, not retried elsewhere, and the
replicas' per-tenant KV gauges are summed."""

from __future__ import annotations

import json

import httpx
import pytest
import server_fixtures
from lora_fixtures import make_adapter
from server_fixtures import Metrics, assert_openai_error, launch_server, make_server_checkpoint, wait_until
from test_router_proxy import BODY, Fleet, answer, run

from pagoda.router.faults import Outcome, classify_answer
from pagoda.router.poller import parse_adapters, parse_stats
from pagoda.wire import ERROR_SCOPE_HEADER, REQUEST_SCOPE

pytestmark = pytest.mark.timeout(300)

MODEL = "pagoda-router-tenants"
FILE = {
    "tenant_header": "X-Tenant",
    "tenants": {
        "acme": {"api_keys": ["sk-acme"], "requests_per_minute": 2, "adapters": []},
        "globex": {"api_keys": ["sk-globex"]},
    },
}
REPLICA_ARGS = ("--num-kv-blocks", "64", "--block-size", "4", "--no-use-kernels", "--max-model-len", "256",
                "--no-tenant-rate-limits")


# --- fake replicas -----------------------------------------------------------------------------------------


def test_a_tenant_429_is_the_requests_own_and_a_load_429_is_the_replicas():
    assert classify_answer(429, {ERROR_SCOPE_HEADER: REQUEST_SCOPE}) is Outcome.REQUEST_FAULT
    assert classify_answer(429, {}) is Outcome.SATURATED


def test_a_replicas_tenant_429_is_relayed_with_its_headers_and_not_retried():
    refused = {"Retry-After": "7", ERROR_SCOPE_HEADER: REQUEST_SCOPE, "x-ratelimit-remaining-requests": "0"}
    over = {"error": {"message": "tenant 'acme' is over its requests per minute", "type": "RateLimitError",
                      "param": None, "code": 429}}
    fleet = Fleet(a=answer(429, over, refused), b=answer())

    async def requests(client, router):
        response = await client.post("/v1/completions", json=BODY)
        assert response.status_code == 429 and response.json() == over
        assert response.headers["retry-after"] == "7" and response.headers["x-ratelimit-remaining-requests"] == "0"
        assert fleet.calls == ["a"], "the tenant's limit is not the replica's: no other replica is tried"
        assert not router.replicas[0].saturated(router.clock()), "nor is the replica skipped as saturated"

    run(fleet, requests)


def test_the_polls_read_adapters_and_each_tenants_kv_blocks():
    models = {"data": [{"id": MODEL}, {"id": "sql", "parent": MODEL}, {"id": "chat", "parent": MODEL}]}
    assert parse_adapters(models) == {"sql", "chat"}
    assert parse_adapters({"detail": "no"}) is None
    text = 'pagoda:tenant_kv_blocks{tenant="acme"} 3.0\npagoda:tenant_kv_blocks{tenant="globex"} 0.0\n'
    assert dict(parse_stats(text).tenant_kv_blocks) == {"acme": 3.0, "globex": 0.0}


# --- real replicas ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("router-tenants")
    model_dir = make_server_checkpoint(root / "model", chat_template=False)
    adapter = make_adapter(model_dir, root / "sql", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=3)
    tenants_file = root / "tenants.json"
    tenants_file.write_text(json.dumps(FILE))
    common = (*REPLICA_ARGS, "--tenant-config", str(tenants_file))
    with_adapter = launch_server(model_dir, root, *common, "--enable-lora", "--lora-modules", f"sql={adapter}",
                                 api_key="sk-admin", served_model_name=MODEL)
    without = launch_server(model_dir, root, *common, api_key="sk-admin", served_model_name=MODEL)
    router = None
    try:
        for replica in (with_adapter, without):
            replica.wait_for_health(200)
        router = server_fixtures.launch_router([with_adapter.url, without.url], root, "--tokenizer", str(model_dir),
                                               "--tenant-config", str(tenants_file), "--api-key", "sk-admin",
                                               "--replica-api-key", "sk-admin", "--retry-backoff", "0.01",
                                               served_model_name=MODEL)
        router.wait_for_health(200)
        router.wait_for_metrics(lambda m: m.value("pagoda_router_replica_up") == 2, "both replicas up", timeout=60)
        yield router, with_adapter, without
    finally:
        for process in (router, with_adapter, without):
            if process is not None:
                process.stop()


def post(router, key: str, model: str, prompt: str, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=router.url, timeout=60) as http:
        return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                         headers={"Authorization": f"Bearer {key}", **headers})


def routed(router, replica) -> float:
    return router.metrics().value("pagoda_router_requests_total", replica=replica.url)


def test_requests_for_an_adapter_go_to_the_replica_that_serves_it(fleet):
    router, with_adapter, without = fleet
    before = routed(router, with_adapter), routed(router, without)
    prompts = ["apple orchard", "blue river", "copper kettle", "dusty road"]
    for prompt in prompts:
        answer = post(router, "sk-globex", "sql", prompt)
        assert answer.status_code == 200 and answer.json()["model"] == "sql", answer.text
    assert routed(router, with_adapter) - before[0] == 4 and routed(router, without) == before[1]
    for prompt in prompts:  # the base model: both replicas serve it, and cache-aware spreads new prompts
        assert post(router, "sk-globex", MODEL, prompt + " again").status_code == 200
    assert routed(router, without) > before[1]


def test_the_key_and_the_gateway_header_reach_the_replicas_and_the_router_counts_the_limits(fleet):
    router, with_adapter, without = fleet

    def on_replicas(tenant: str) -> float:
        return sum(Metrics.parse(httpx.get(f"{r.url}/metrics", timeout=10).text).value(
            "pagoda:tenant_requests_total", tenant=tenant, outcome="admitted") for r in (with_adapter, without))

    before = on_replicas("globex")
    assert post(router, "sk-admin", MODEL, "through a gateway", **{"X-Tenant": "globex"}).status_code == 200
    assert post(router, "sk-globex", MODEL, "with its own key").status_code == 200
    assert on_replicas("globex") - before == 2
    statuses = [post(router, "sk-acme", MODEL, f"{word} acme").status_code for word in ("one", "two", "three")]
    assert statuses == [200, 200, 429]
    assert on_replicas("acme") == 2
    assert_openai_error(post(router, "sk-globex", "sql", "x", **{"X-Tenant": "acme"}), 403,
                        contains=["may not use the adapter `sql`"])
    wait_until(lambda: router.metrics().value("pagoda:tenant_requests_total", tenant="acme",
                                              outcome="rate_limited") == 1, 5, "the router's count")
