"""Tenants: the file's checks, who a request is for, the token buckets (on a fake clock), and over real HTTP
against `pagoda serve --tenant-config`: per-tenant 429s with Retry-After and OpenAI's x-ratelimit headers while
the other tenants go on, token limits, a tenant's own prefix-cache namespace, an unknown gateway tenant, the
per-tenant metrics, and the file reloaded on SIGHUP (new limits and new keys, a broken file ignored).
"""

from __future__ import annotations

import json
import signal

import pytest
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server, wait_until

from pagoda.api_keys import ApiKeys
from pagoda.server.tenancy import Tenants
from pagoda.tenants import DEFAULT_TENANT, TenantLimits, TenantTable
from pagoda.wire import OpenAIError

pytestmark = pytest.mark.timeout(300)

FILE = {
    "tenant_header": "X-Tenant",
    "tenants": {
        "acme": {"api_keys": ["sk-acme"], "requests_per_minute": 2},
        "globex": {"api_keys": ["sk-globex", "sk-globex-2"], "requests_per_minute": 600, "adapters": []},
        "initech": {"api_keys": ["sk-initech"], "tokens_per_minute": 60},
        "default": {"share_prefix_cache": True},
    },
}


# --- the file and the buckets, in process ---------------------------------------------------------------


@pytest.mark.parametrize("document, message", [
    ({"tenants": {"a": {"rpm": 3}}}, "tenant 'a': unknown key(s) rpm"),
    ({"tennants": {}}, "unknown key(s) tennants"),
    ({"tenants": {"a": {"requests_per_minute": 0}}}, "requests_per_minute must be a positive integer"),
    ({"tenants": {"a": {"tokens_per_minute": True}}}, "tokens_per_minute must be a positive integer"),
    ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "share an API key"),
    ({"tenants": {"a": {"api_keys": [" k"]}}}, "api_keys must be a list"),
    ({"tenants": {"a": {"share_prefix_cache": "yes"}}}, "share_prefix_cache must be true or false"),
    ({"tenants": {"a": {"request_burst": 5}}}, "request_burst needs requests_per_minute"),
    ({"tenants": {"a": {"requests_per_minute": 5, "request_burst": 0}}}, "request_burst must be a positive integer"),
    ([], "must hold a JSON object"),
])
def test_a_bad_tenants_file_is_refused_naming_what_is_wrong(document, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TenantTable.parse(document)


def test_a_request_is_the_headers_tenant_else_its_keys_else_default():
    table = TenantTable.parse(FILE)
    assert table.identify({"authorization": "Bearer sk-globex-2"}).name == "globex"
    assert table.identify({"authorization": "bearer sk-acme"}).name == "acme"
    assert table.identify({"authorization": "Bearer sk-acme-not"}).name == DEFAULT_TENANT
    assert table.identify({"x-tenant": "initech", "authorization": "Bearer sk-acme"}).name == "initech"
    with pytest.raises(ValueError, match="unknown tenant 'nobody' in header x-tenant"):
        table.identify({"x-tenant": "nobody"})
    assert TenantTable.parse({"tenants": {"a": {"api_keys": ["k"]}}}).identify({}) is None  # no default: nobody's


def test_requests_per_minute_refill_continuously_and_say_when():
    table, limits = TenantTable.parse(FILE), TenantLimits()
    acme = table.tenants["acme"]
    assert limits.admit(acme, 0.0) is None and limits.admit(acme, 0.0) is None
    refusal = limits.admit(acme, 0.0)
    assert refusal is not None and refusal.limit == "requests" and refusal.retry_after == pytest.approx(30.0)
    assert limits.headers(acme, 0.0) == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0",
                                         "x-ratelimit-reset-requests": "60s"}
    assert limits.admit(acme, 29.0) is not None
    assert limits.admit(acme, 30.0) is None  # one request refilled after half a minute


def test_a_burst_smaller_than_a_minute_admits_that_many_at_once_then_the_rate():
    table = TenantTable.parse({"tenants": {"a": {"requests_per_minute": 60, "request_burst": 3}}})
    tenant, limits = table.tenants["a"], TenantLimits()
    assert [limits.admit(tenant, 0.0) is None for _ in range(4)] == [True, True, True, False]
    assert limits.headers(tenant, 0.0) == {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "0",
                                           "x-ratelimit-reset-requests": "3s"}
    assert limits.admit(tenant, 1.0) is None and limits.admit(tenant, 1.0) is not None  # one a second
    assert [limits.admit(tenant, 100.0) is None for _ in range(4)] == [True, True, True, False]  # never above 3
    # a reload that changes the burst starts the bucket afresh
    wider = TenantTable.parse({"tenants": {"a": {"requests_per_minute": 60, "request_burst": 5}}}).tenants["a"]
    assert [limits.admit(wider, 100.0) is None for _ in range(6)] == [True] * 5 + [False]


def test_tokens_are_a_debt_that_later_requests_wait_out():
    initech, limits = TenantTable.parse(FILE).tenants["initech"], TenantLimits()
    assert limits.admit(initech, 0.0) is None
    limits.charge(initech, 90, 0.0)  # 30 over its 60 a minute
    refusal = limits.admit(initech, 0.0)
    assert refusal is not None and refusal.limit == "tokens" and refusal.retry_after == pytest.approx(31.0)
    assert limits.admit(initech, 31.0) is None


def test_a_tenant_keeps_its_prefix_cache_namespace_unless_it_shares():
    table = TenantTable.parse(FILE)
    assert table.tenants["acme"].cache_salt(None) == "tenant:acme"
    assert table.tenants["acme"].cache_salt("s") == "tenant:acme|s"
    assert table.tenants[DEFAULT_TENANT].cache_salt("s") == "s"


def test_the_door_refuses_adapters_a_tenant_may_not_use(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(FILE))
    tenants = Tenants(ApiKeys.gather(["sk-admin"], environ={}), path)
    with pytest.raises(OpenAIError) as refused:
        tenants.enter({"authorization": "Bearer sk-globex"}, "sql-adapter")
    assert refused.value.status == 403 and refused.value.param == "model"
    assert tenants.enter({"authorization": "Bearer sk-acme"}, "sql-adapter") is not None  # no list: any adapter
    assert tenants.accepts("Bearer sk-admin") and tenants.accepts("Bearer sk-initech")
    assert not tenants.accepts("Bearer sk-nobody")


# --- over real HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps(FILE))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, tenants_file):
    root = tmp_path_factory.mktemp("tenant-server")
    model_dir = make_server_checkpoint(root / "model", chat_template=False)
    server = start_server(model_dir, root, "--tenant-config", str(tenants_file), "--block-size", "4",
                          api_key="sk-admin")
    yield server
    server.stop()


def completion(server, key: str | None, prompt: str = "hello there", max_tokens: int = 2, **headers: str):
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    with server.http() as http:
        http.headers.pop("Authorization", None)
        return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                         headers=headers)


def test_a_tenant_over_its_requests_gets_429s_while_the_others_go_on(server):
    first, second = completion(server, "sk-acme"), completion(server, "sk-acme")
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    refused = completion(server, "sk-acme")
    assert_openai_error(refused, 429, contains=["tenant 'acme' is over its requests per minute"])
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    client = server.client("sk-globex")  # the official client, for another tenant meanwhile
    raw = client.completions.with_raw_response.create(model=server.model_name, prompt="hello", max_tokens=2)
    assert raw.http_response.status_code == 200 and raw.headers["x-ratelimit-limit-requests"] == "600"
    assert completion(server, "sk-admin").status_code == 200  # --api-key's key: the default tenant, no limits
    metrics = server.metrics()
    assert metrics.value("pagoda:tenant_requests_total", tenant="acme", outcome="rate_limited") >= 1
    assert metrics.value("pagoda:tenant_requests_total", tenant="acme", outcome="admitted") >= 2
    assert metrics.value("pagoda:tenant_tokens_total", tenant="globex", kind="generation") >= 2


def test_a_tenant_over_its_tokens_waits_for_them(server):
    first = completion(server, "sk-initech", prompt="count " * 40, max_tokens=30)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used > 60
    refused = completion(server, "sk-initech")
    assert_openai_error(refused, 429, contains=["over its tokens per minute"])
    # the debt (used - 60 tokens) and one more, at its one token a second, less what has refilled since
    assert used - 60 - 10 <= int(refused.headers["retry-after"]) <= used - 60 + 1
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"


def test_each_tenant_has_its_own_prefix_cache_unless_it_shares(server):
    prompt = "the same long prompt shared by two tenants " * 3

    def cached(key: str) -> int:
        response = completion(server, key, prompt=prompt)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("sk-globex") == 0
    assert cached("sk-globex-2") > 0  # the same tenant, another of its keys
    assert cached("sk-admin") == 0  # the default tenant shares the common namespace, which does not hold it
    assert cached("sk-admin") > 0


def test_a_gateways_header_names_the_tenant(server):
    assert completion(server, "sk-admin", **{"X-Tenant": "globex"}).headers["x-ratelimit-limit-requests"] == "600"
    assert_openai_error(completion(server, "sk-admin", **{"X-Tenant": "umbrella"}), 403,
                        contains=["unknown tenant 'umbrella'"])


def test_sighup_reloads_limits_and_keys_and_a_broken_file_changes_nothing(server, tenants_file):
    assert completion(server, "sk-new").status_code == 401
    changed = json.loads(json.dumps(FILE))
    changed["tenants"]["acme"]["requests_per_minute"] = 1000
    changed["tenants"]["hooli"] = {"api_keys": ["sk-new"], "requests_per_minute": 5}
    tenants_file.write_text(json.dumps(changed))
    server.process.send_signal(signal.SIGHUP)
    wait_until(lambda: completion(server, "sk-new").status_code == 200, 10, "the new key to open the door")
    assert completion(server, "sk-acme").headers["x-ratelimit-limit-requests"] == "1000"
    tenants_file.write_text("{not json")
    server.process.send_signal(signal.SIGHUP)
    wait_until(lambda: "not reloaded" in server.log_tail(), 10, "the reload to be refused")
    assert completion(server, "sk-new").status_code == 200
    assert server.health() == 200
