"""Tenants with `pagoda serve --data-parallel-size 2`, over real HTTP: the router in front holds the one set of
token buckets, so a tenant over its requests per minute meets the same answers (200s, then 429s, the same
x-ratelimit headers) across two engines as from one server; the engines find the same tenant from the key or
the gateway header that reaches them unchanged (their per-tenant counters), count no limit themselves, and the
KV blocks each tenant holds are a gauge on the engine and, summed, on the router.
"""

from __future__ import annotations

import json
import math
import signal

import httpx
import pytest
from server_fixtures import (
    Metrics,
    assert_openai_error,
    launch_server,
    make_server_checkpoint,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
FILE = {
    "tenant_header": "X-Tenant",
    "tenants": {
        "acme": {"api_keys": ["sk-acme"], "requests_per_minute": 3, "weight": 2},
        "globex": {"api_keys": ["sk-globex"], "requests_per_minute": 600},
    },
}
# Prompts that share no first block: the router's cache-aware policy spreads them over the engines.
PROMPTS = ["apple orchard in the valley", "blue river under stone", "copper kettle on the fire",
           "dusty road to the north", "eager falcon over the hills"]
LONG_ANSWER = 1800  # tokens: long enough to be running still when /metrics is read
ENGINE_ARGS = ("--num-kv-blocks", "600", "--block-size", str(BLOCK_SIZE), "--no-use-kernels", "--max-model-len",
               "2048")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server, and two engines behind the data-parallel router, with the same tenants file."""
    root = tmp_path_factory.mktemp("tenants-dp")
    model_dir = make_server_checkpoint(root / "model", chat_template=False, max_position_embeddings=2048)
    tenants_file = root / "tenants.json"
    tenants_file.write_text(json.dumps(FILE))
    parallel = launch_server(model_dir, root, "--data-parallel-size", "2", "--threads", "2", *ENGINE_ARGS,
                             "--tenant-config", str(tenants_file), api_key="sk-admin", served_model_name="dp")
    single = None
    try:
        single = start_server(model_dir, root, *ENGINE_ARGS, "--tenant-config", str(tenants_file), api_key="sk-admin",
                              served_model_name="one")
        parallel.wait_for_health(200)
        wait_until(lambda: len(engine_urls(parallel)) == 2, 120, "both engines up")
        yield single, parallel, tenants_file
    finally:
        for server in (parallel, single):
            if server is not None:
                server.stop()


def engine_urls(parallel) -> list[str]:
    metrics = parallel.metrics()
    return [labels["replica"] for labels in metrics.labels_of("pagoda_router_replica_up")
            if metrics.value("pagoda_router_replica_up", **labels) == 1]


def engine_metrics(parallel) -> list[Metrics]:
    return [Metrics.parse(httpx.get(f"{url}/metrics", timeout=10).text) for url in engine_urls(parallel)]


def completion(server, key: str, prompt: str, max_tokens: int = 2, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                         headers={"Authorization": f"Bearer {key}", **headers})


def answers(server, key: str, count: int) -> list[tuple[int, str | None]]:
    """(status, x-ratelimit-remaining-requests) of `count` requests with distinct prompts (which the router
    spreads over its engines)."""
    seen = []
    for index in range(count):
        response = completion(server, key, PROMPTS[index])
        seen.append((response.status_code, response.headers.get("x-ratelimit-remaining-requests")))
        if response.status_code == 429:
            assert_openai_error(response, 429, contains=["tenant 'acme' is over its requests per minute"])
            assert 1 <= int(response.headers["retry-after"]) <= 20
    return seen


def test_a_tenant_over_its_requests_gets_429_across_two_engines_exactly_as_from_one(servers):
    single, parallel, _ = servers
    expected = [(200, "2"), (200, "1"), (200, "0"), (429, "0"), (429, "0")]
    assert answers(single, "sk-acme", 5) == expected
    assert answers(parallel, "sk-acme", 5) == expected
    # The limits were the router's: both engines served acme (the key reached them), neither refused it.
    engines = engine_metrics(parallel)
    admitted = [m.value("pagoda:tenant_requests_total", tenant="acme", outcome="admitted") for m in engines]
    assert len(admitted) == 2 and min(admitted) > 0 and sum(admitted) == 3, admitted
    assert all(m.value("pagoda:tenant_requests_total", tenant="acme", outcome="rate_limited") == 0 for m in engines)
    front = parallel.metrics()
    assert front.value("pagoda:tenant_requests_total", tenant="acme", outcome="admitted") == 3
    assert front.value("pagoda:tenant_requests_total", tenant="acme", outcome="rate_limited") == 2
    assert front.value("pagoda:tenant_tokens_total", tenant="acme", kind="generation") == 6  # 3 answers x 2


def test_the_gateways_header_and_the_key_reach_the_engines_unchanged(servers):
    _, parallel, _ = servers
    before = sum(m.value("pagoda:tenant_requests_total", tenant="globex") for m in engine_metrics(parallel))
    by_header = completion(parallel, "sk-admin", "a gateway's request", **{"X-Tenant": "globex"})
    assert by_header.status_code == 200 and by_header.headers["x-ratelimit-limit-requests"] == "600"
    assert completion(parallel, "sk-globex", "the tenant's own key").status_code == 200
    after = sum(m.value("pagoda:tenant_requests_total", tenant="globex") for m in engine_metrics(parallel))
    assert after - before == 2
    assert_openai_error(completion(parallel, "sk-admin", "x", **{"X-Tenant": "umbrella"}), 403,
                        contains=["unknown tenant 'umbrella'"])
    assert completion(parallel, "sk-nobody", "x").status_code == 401


def test_each_tenants_kv_blocks_are_a_gauge_on_the_engine_and_summed_on_the_router(servers):
    single, parallel, _ = servers
    prompt = "a prompt of some length for the gauge " * 2
    with httpx.Client(base_url=single.url, timeout=60) as http, http.stream(
            "POST", "/v1/completions", headers={"Authorization": "Bearer sk-globex"},
            json={"prompt": prompt, "max_tokens": LONG_ANSWER, "ignore_eos": True, "stream": True}) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
        next(lines)  # the request is running: it holds its prompt's blocks and more
        num_prompt_blocks = math.ceil(len(prompt.split()) / BLOCK_SIZE)  # at least a token a word
        metrics = single.metrics()
        assert metrics.value("pagoda:tenant_kv_blocks", tenant="globex") >= num_prompt_blocks
        assert metrics.value("pagoda:tenant_kv_blocks", tenant="acme") == 0
        assert {labels["tenant"] for labels in metrics.labels_of("pagoda:tenant_kv_blocks")} == {"acme", "globex"}
    single.wait_for_metrics(lambda m: m.value("pagoda:tenant_kv_blocks", tenant="globex") == 0,
                            "the blocks given back once the stream closed")
    # The router sums its engines' gauges as it polls them (tests/test_router_tenants.py checks the sum).
    front = parallel.wait_for_metrics(lambda m: len(m.labels_of("pagoda:tenant_kv_blocks")) == 2,
                                      "the engines' gauges at the router")
    assert {labels["tenant"] for labels in front.labels_of("pagoda:tenant_kv_blocks")} == {"acme", "globex"}


def test_sighup_to_the_parent_reloads_the_limits_in_front(servers):
    _, parallel, tenants_file = servers
    changed = json.loads(json.dumps(FILE))
    changed["tenants"]["acme"]["requests_per_minute"] = 1000
    tenants_file.write_text(json.dumps(changed))
    try:
        parallel.process.send_signal(signal.SIGHUP)
        wait_until(lambda: completion(parallel, "sk-acme", "after the reload").headers.get(
            "x-ratelimit-limit-requests") == "1000", 20, "the new limit in force")
    finally:
        tenants_file.write_text(json.dumps(FILE))
