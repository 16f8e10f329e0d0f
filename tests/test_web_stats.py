"""The web UI's server side, without a model or a browser: the record of the last minutes (percentiles,
window, rates), the routes' access rules (pages open, stats guarded, --disable-web-ui) and the static files'
headers. The pages themselves are tested in a real browser by test_web_ui.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
from server_fixtures import assert_openai_error

from pagoda.api_keys import ApiKeys
from pagoda.cli import build_parser, run_serve
from pagoda.server import launcher
from pagoda.server.activity import LATENCY_BIN_RATIO, RecentActivity, latency_bin, percentiles
from pagoda.server.api import build_app
from pagoda.server.state import ServerState
from pagoda.server.web import PAGES, STATS_PATH, static_files

KEY = "web-key"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- the record of the last minutes ------------------------------------------------------------------


def exact_percentile(values: list[float], p: int) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * p // 100) - 1)]


def test_percentiles_from_bins_are_within_half_a_bin_of_the_exact_ones():
    rng = random.Random(0)
    values = [rng.lognormvariate(-4, 1.5) for _ in range(5000)]
    binned = percentiles(Counter(latency_bin(v) for v in values))
    assert binned is not None
    for p in (50, 90, 99):
        exact = exact_percentile(values, p)
        assert abs(binned[f"p{p}"] / exact - 1) <= LATENCY_BIN_RATIO - 1, (p, binned, exact)


def test_no_samples_no_percentiles():
    assert percentiles(Counter()) is None
    snapshot = RecentActivity(clock=FakeClock()).snapshot()
    assert snapshot["buckets"] == [] and snapshot["ttft"] is None and snapshot["itl"] is None
    assert snapshot["generation_tokens_per_s"] == 0


def test_outputs_land_in_buckets_and_leave_the_window():
    clock = FakeClock(1000.0)
    recent = RecentActivity(clock=clock, window_s=60, bucket_s=10)
    recent.first_token(0.5, prompt_tokens=20, new_tokens=1)
    for _ in range(9):
        recent.next_tokens(0.01, new_tokens=1)
    clock.now += 10
    recent.first_token(2.0, prompt_tokens=30, new_tokens=2)
    snapshot = recent.snapshot()
    first, second = snapshot["buckets"]
    assert (first["requests"], first["prompt_tokens"], first["generation_tokens"]) == (1, 20, 10)
    assert (second["requests"], second["prompt_tokens"], second["generation_tokens"]) == (1, 30, 2)
    assert second["t"] - first["t"] == pytest.approx(10)
    assert first["itl"]["p50"] == pytest.approx(0.01, rel=0.03) and second["itl"] is None
    assert snapshot["ttft"]["p50"] == pytest.approx(0.5, rel=0.03)  # nearest rank of two: the lower
    assert snapshot["ttft"]["p99"] == pytest.approx(2.0, rel=0.03)
    # 12 tokens since the start of the previous bucket, 10 s ago
    assert snapshot["generation_tokens_per_s"] == pytest.approx(12 / 10)
    clock.now += 55  # the first bucket is now more than a window old; the second is not
    later = recent.snapshot()
    assert [b["requests"] for b in later["buckets"]] == [1]
    assert later["ttft"]["p50"] == pytest.approx(2.0, rel=0.03) and later["itl"] is None  # its samples left too
    clock.now += 600
    assert recent.snapshot()["buckets"] == [] and recent.snapshot()["ttft"] is None


def test_the_ring_holds_at_most_one_window_of_buckets():
    clock = FakeClock(0.0)
    recent = RecentActivity(clock=clock, window_s=30, bucket_s=5)
    for _ in range(100):
        recent.next_tokens(0.02, new_tokens=1)
        clock.now += 5
    assert len(recent.buckets) == 6
    assert sum(recent.window_itl.values()) == 6  # the window's bins hold the buckets' samples, no more


# --- routes -------------------------------------------------------------------------------------------


def get_all(app, paths, headers=None) -> dict[str, httpx.Response]:
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda") as client:
            return {path: await client.get(path, headers=headers) for path in paths}

    return asyncio.run(main())


def test_pages_are_served_from_the_package_with_a_strict_content_security_policy():
    files = static_files()
    assert set(PAGES) <= set(files) and {"/web/chat.js", "/web/dashboard.js", "/web/style.css"} <= set(files)
    responses = get_all(build_app(ServerState(model_name="m")), list(files))
    for path, response in responses.items():
        assert response.status_code == 200, (path, response.text)
        assert response.content == files[path].read_bytes()
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy, policy
        assert response.headers["x-content-type-options"] == "nosniff"
    assert responses["/"].headers["content-type"].startswith("text/html")
    assert responses["/web/chat.js"].headers["content-type"].startswith("text/javascript")
    for path in PAGES:  # no inline script: everything the policy allows comes from /web/
        assert "<script>" not in responses[path].text and 'src="/web/common.js"' in responses[path].text


def test_with_an_api_key_the_pages_are_open_and_the_stats_are_guarded():
    app = build_app(ServerState(model_name="m", api_keys=ApiKeys.gather([KEY], environ={})))
    pages = get_all(app, [*static_files(), STATS_PATH])
    for path in static_files():
        assert pages[path].status_code == 200, path
    assert_openai_error(pages[STATS_PATH], 401)
    with_key = get_all(app, [STATS_PATH], {"Authorization": f"Bearer {KEY}"})
    assert_openai_error(with_key[STATS_PATH], 503, contains=["loading"])  # past the guard; no model yet


def test_disable_web_ui_turns_the_pages_and_the_stats_off():
    app = build_app(ServerState(model_name="m", web_ui=False))
    for path, response in get_all(app, [*static_files(), STATS_PATH]).items():
        assert response.status_code == 404, path
        assert_openai_error(response, 404)
    keyed = build_app(ServerState(model_name="m", web_ui=False, api_keys=ApiKeys.gather([KEY], environ={})))
    assert get_all(keyed, ["/"])["/"].status_code == 401  # no page is public any more


def test_unknown_files_under_web_are_not_found():
    app = build_app(ServerState(model_name="m"))
    for path in ("/web/../api.py", "/web/nothing.js", "/web/", "/web/index.html"):
        assert get_all(app, [path])[path].status_code == 404, path


def test_the_serve_flag_reaches_the_server(monkeypatch):
    given: dict = {}
    monkeypatch.setattr(launcher, "serve", lambda _config, **options: given.update(options) or 0)
    monkeypatch.setattr(launcher, "exit_now", lambda _code: None)
    for flags, web_ui in (([], True), (["--disable-web-ui"], False)):
        run_serve(build_parser().parse_args(["serve", *flags]))
        assert given["web_ui"] is web_ui, flags
