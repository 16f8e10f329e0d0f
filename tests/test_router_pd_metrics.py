"""The router's /metrics under --pd-disaggregation, against fake replicas (httpx.MockTransport): both pools'
replicas, each pool's request count, the handoffs and the fallbacks (each reason), in Prometheus text."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.router.app import build_router_app
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.disaggregated import disaggregated_routers
from pagoda.router.tokens import LoadOnlyReader

pytestmark = pytest.mark.timeout(60)

TRANSFER = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_block_ids": [1, 2], "remote_host": "10.0.0.5", "remote_port": 40123}
COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "hi"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_show_both_pools_their_requests_transfers_and_fallbacks():
    prefill_answers: list[httpx.Response] = []
    decode_bodies: list[dict] = []

    def fleet(request: httpx.Request) -> httpx.Response:
        if request.url.host.startswith("prefill"):
            return prefill_answers.pop(0)
        decode_bodies.append(json.loads(request.content))
        return httpx.Response(200, json=COMPLETION)

    decode, prefill = disaggregated_routers(["http://decode-0", "http://decode-1"], ["http://prefill-0"],
                                            RouterConfig(policy="round_robin", retry_backoff_s=0.001, max_retries=0))
    for replica in [*decode.replicas, *prefill.replicas]:  # as the poller's first health check finds them
        decode.set_health(replica, True)
    app = build_router_app(decode, LoadOnlyReader(), httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
                           prefill_router=prefill)
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}

    async def main() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as client:
            prefill_answers.extend([httpx.Response(200, json={**COMPLETION, "kv_transfer_params": TRANSFER}),
                                    httpx.Response(200, json={**COMPLETION, "kv_transfer_params": TRANSFER}),
                                    httpx.Response(400, json={"error": {"message": "bad", "code": 400}}),
                                    httpx.Response(200, json=COMPLETION)])
            for _ in range(4):
                assert (await client.post("/v1/completions", json=body)).status_code == 200
            # Several prompts are not split: straight to the decode pool.
            several = {**body, "prompt": ["a", "b"]}
            assert (await client.post("/v1/completions", json=several)).status_code == 200
            prefill.set_health(prefill.replicas[0], False)  # no prefill replica up: the decode replica computes
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            response = await client.get("/metrics")
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
            return response.text

    found = samples(asyncio.run(main()))
    assert [b.get("kv_transfer_params") for b in decode_bodies] == [TRANSFER, TRANSFER, None, None, None, None]
    assert found[("pagoda_router_pool_requests_total", (("pool", "prefill"),))] == 5
    assert found[("pagoda_router_pool_requests_total", (("pool", "decode"),))] == 6
    assert found[("pagoda_router_pd_transfers_total", ())] == 2
    fallbacks = {reason: found[("pagoda_router_pd_fallbacks_total", (("reason", reason),))]
                 for reason in ("prefill_error", "no_kv_transfer_params", "no_prefill_replica")}
    assert fallbacks == {"prefill_error": 1, "no_kv_transfer_params": 1, "no_prefill_replica": 1}
    assert found[("pagoda_router_pool_replicas", (("pool", "prefill"),))] == 1
    assert found[("pagoda_router_pool_replicas", (("pool", "decode"),))] == 2
    assert found[("pagoda_router_pool_replicas_up", (("pool", "prefill"),))] == 0
    assert found[("pagoda_router_pool_replicas_up", (("pool", "decode"),))] == 2
    # Both pools' replicas, one series each, in the per-replica families.
    assert found[("pagoda_router_requests_total", (("replica", "http://prefill-0"),))] == 4
    assert sum(found[("pagoda_router_requests_total", (("replica", f"http://decode-{i}"),))] for i in (0, 1)) == 6
    assert {("pagoda_router_replica_up", (("replica", url),)) for url in
            ("http://prefill-0", "http://decode-0", "http://decode-1")} <= set(found)


def test_a_colocated_router_has_no_pool_series():
    decode, _ = disaggregated_routers(["http://d"], ["http://p"], RouterConfig())
    plain = Router(["http://r"], RouterConfig()).metrics.render().decode()
    assert "pagoda_router_pool_requests" not in plain and "pagoda_router_pd_" not in plain
    assert "pagoda_router_pd_transfers_total 0.0" in decode.metrics.render().decode()
