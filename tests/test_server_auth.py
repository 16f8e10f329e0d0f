"""API keys: every route that reads or changes engine state or costs compute needs one; /health, /version
and /metrics stay open (/metrics too is guarded with --guard-metrics), and so do the web UI's static files.

Most tests drive the app in process, before any model is loaded: a guarded route answers 401 without a
valid key and, with one, gets past the guard (to the 503 of a model still loading). One real server checks
where keys come from: repeated --api-key, --api-key-file and the environment.
"""

from __future__ import annotations

import asyncio
import hmac

import httpx
import pytest
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server

from pagoda import api_keys
from pagoda.api_keys import OPEN_PATHS, ApiKeys
from pagoda.server.api import build_app
from pagoda.server.state import ServerState
from pagoda.server.web import static_files

pytestmark = pytest.mark.timeout(120)

KEYS = ("first-key", "second-key")
OPEN = OPEN_PATHS | set(static_files())  # the probes, and the web UI's pages (which hold no data)
BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}


def app_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, OpenAPI and docs pages included."""
    routes = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, route.path))
    return routes


def call_all(app, headers: dict[str, str]) -> dict[tuple[str, str], httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda") as client:
            return {(method, path): await client.request(method, path, json=BODIES.get(path), headers=headers)
                    for method, path in app_routes(app)}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def app():
    return build_app(ServerState(model_name="m", api_keys=ApiKeys.gather(KEYS, environ={})))


def test_every_route_but_the_probes_needs_a_key(app):
    guarded = [(m, p) for m, p in app_routes(app) if p not in OPEN]
    assert {p for _, p in guarded} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                                       "/detokenize", "/reset_prefix_cache"}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEYS[0]},
                    {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEYS[0]}x"}, {"Authorization": f"Bearer {KEYS[0][:-1]}"},
                    {"X-API-Key": KEYS[0]}):
        responses = call_all(app, headers)
        for route in guarded:
            error = assert_openai_error(responses[route], 401)
            assert error["type"] == "AuthenticationError", (route, headers, error)
        for route, response in responses.items():
            if route[1] in OPEN:
                assert response.status_code != 401, (route, headers)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
@pytest.mark.parametrize("key", KEYS)
def test_any_configured_key_opens_every_route_with_the_scheme_in_any_case(app, scheme, key):
    responses = call_all(app, {"Authorization": f"{scheme} {key}"})
    for route, response in responses.items():
        assert response.status_code != 401, (route, response.text)
    # Past the guard, the model is still loading: that is what the routes that need it say.
    for path in ("/v1/models", "/v1/completions", "/tokenize", "/reset_prefix_cache"):
        method = "GET" if path == "/v1/models" else "POST"
        assert_openai_error(responses[(method, path)], 503)


def test_guard_metrics_guards_metrics_and_nothing_else_opens():
    app = build_app(ServerState(model_name="m", api_keys=ApiKeys.gather(KEYS, environ={}, guard_metrics=True)))
    open_responses = call_all(app, {})
    assert_openai_error(open_responses[("GET", "/metrics")], 401)
    assert open_responses[("GET", "/health")].status_code == 503  # loading, but answered
    assert open_responses[("GET", "/version")].status_code == 200
    assert call_all(app, {"Authorization": f"Bearer {KEYS[1]}"})[("GET", "/metrics")].status_code == 200


def test_without_keys_nothing_is_guarded():
    app = build_app(ServerState(model_name="m"))
    for route, response in call_all(app, {}).items():
        assert response.status_code != 401, route


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    compared, compare_digest = [], hmac.compare_digest

    def spy(presented, key):
        compared.append(key)
        return compare_digest(presented, key)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    keys = ApiKeys.gather(KEYS, environ={})
    assert keys.accepts(f"Bearer {KEYS[0]}")
    assert compared == [k.encode() for k in KEYS]  # no early exit on the first match


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key per line\nfile-key-1\n\n  file-key-2  \n", encoding="utf-8")
    keys = ApiKeys.gather(["flag-key"], key_file, environ={"PAGODA_API_KEY": "env-key", "VLLM_API_KEY": "vllm-key"})
    for key in ("flag-key", "file-key-1", "file-key-2", "env-key", "vllm-key"):
        assert keys.accepts(f"Bearer {key}"), key
    assert not keys.accepts("Bearer # one key per line")
    assert not ApiKeys.gather([], None, environ={}).enabled
    with pytest.raises(ValueError):
        ApiKeys.gather([" padded "], environ={})


# --------------------------------------------------------------------------------------------------
# A real server: keys from repeated flags, a file and the environment
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-auth")
    model_dir = make_server_checkpoint(root / "model")
    key_file = root / "keys.txt"
    key_file.write_text("file-key\n", encoding="utf-8")
    server = start_server(model_dir, root, "--num-kv-blocks", "32", "--block-size", "16", "--api-key", "flag-key-1",
                          "--api-key", "flag-key-2", "--api-key-file", str(key_file), served_model_name="auth",
                          env={"PAGODA_API_KEY": "env-key", "VLLM_API_KEY": "vllm-env-key"})
    yield server
    server.stop()


def test_a_served_model_takes_each_configured_key(server):
    for key in ("flag-key-1", "flag-key-2", "file-key", "env-key", "vllm-env-key"):
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                              headers={"Authorization": f"bearer {key}"}, timeout=30)
        assert response.status_code == 200, (key, response.text)
    for path in ("/tokenize", "/detokenize", "/reset_prefix_cache"):
        assert_openai_error(httpx.post(f"{server.url}{path}", json=BODIES.get(path), timeout=30), 401)
        assert_openai_error(httpx.post(f"{server.url}{path}", json=BODIES.get(path), timeout=30,
                                       headers={"Authorization": "Bearer nope"}), 401)
        response = httpx.post(f"{server.url}{path}", json=BODIES.get(path), timeout=30,
                              headers={"Authorization": "Bearer file-key"})
        assert response.status_code == 200, (path, response.text)
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.url}{path}", timeout=30).status_code == 200, path
