"""The dashboard's KV-tiers panel in a real browser (chromium, Playwright), against `pagoda serve` with a local
offload tier and a KV pool small enough that a returning prompt has been evicted from it: the panel's hit and
byte counts are 0 before the return and move once the tier supplies the prompt, and they agree with the
server's /metrics."""

from __future__ import annotations

import random

import pytest
from playwright.sync_api import Page
from server_fixtures import Metrics, start_server
from test_web_ui import KEY, browser, page, wait_for_text  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(180)

BLOCK_SIZE = 16
PROMPT_TOKENS = 160  # 10 blocks; the pool of 24 holds two such prompts


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("web-kv-tiers"), "--threads", "1", "--num-kv-blocks", "24",
                          "--block-size", str(BLOCK_SIZE), "--kv-offloading-size", "0.01", api_key=KEY)
    yield server
    server.stop()


def complete(server, prompt: list[int]) -> None:
    response = server.post("/v1/completions", {"model": server.get("/v1/models").json()["data"][0]["id"],
                                               "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text


def cell(tab: Page, medium: str, key: str) -> str:
    return tab.text_content(f'#kv-tiers-rows tr[data-medium="{medium}"] td[data-key="{key}"]') or ""


def test_the_kv_tiers_panel_shows_a_tier_hit_when_an_evicted_prompt_returns(page: Page, server):  # noqa: F811
    rng = random.Random(5)
    first, *others = [[rng.randrange(10, 200) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
    page.goto("/dashboard?refresh=200")
    wait_for_text(page, '#kv-tiers-rows tr[data-medium="CPU"] td[data-key="hit_tokens"]', "text => text === '0'")
    assert page.is_visible("#kv-tiers")
    for prompt in (first, *others):  # the others push the first out of the pool, into the tier below
        complete(server, prompt)
    wait_for_text(page, '#kv-tiers-rows tr[data-medium="CPU"] td[data-key="bytes_saved"]', "text => text !== '0 B'")
    assert cell(page, "CPU", "hit_tokens") == "0"
    complete(server, first)
    wait_for_text(page, '#kv-tiers-rows tr[data-medium="CPU"] td[data-key="hit_tokens"]', "text => text !== '0'")
    metrics = Metrics.parse(server.get("/metrics").text)
    hit_tokens = next(value for (name, labels), value in metrics.samples.items()
                      if name == "pagoda:kv_offload_hit_tokens_total" and ("medium", "CPU") in labels)
    assert int(cell(page, "CPU", "hit_tokens")) == int(hit_tokens) >= (PROMPT_TOKENS // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert int(cell(page, "CPU", "hit_blocks")) == int(hit_tokens) // BLOCK_SIZE
    assert cell(page, "CPU", "bytes_loaded") != "0 B" and cell(page, "CPU", "load_seconds") != "–"
    assert "loaded" in (page.text_content("#kv-tiers-summary") or "")

