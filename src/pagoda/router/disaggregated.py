"""`pagoda route --pd-disaggregation`: each generation runs its prompt on a prefill replica and its answer on a
decode replica (docs/disaggregation.md).

vLLM's flow: the request goes to a prefill replica as it came, but with `max_tokens` 1, one choice, no stream and
`kv_transfer_params: {"do_remote_decode": true}`; that replica computes the prompt, holds its KV and answers
where to pull it (`kv_transfer_params` in its response). The request then goes, as the client sent it, to a
decode replica with those kv_transfer_params: it pulls the prompt's blocks, computes the last prompt token
and streams the answer to the client. Each pool has its own Router (choice, load, breaker, retries): a dead
prefill replica is routed around; with none left, or any failure of the prefill step, the decode replica
computes the prompt itself, so a request is never lost to the split.

Only a single-prompt completion or chat completion is split; everything else (several prompts, the Responses
API, embeddings) goes to the decode pool whole.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi.responses import Response

from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import RoutedPrompt
from pagoda.router.proxy import Forwarder
from pagoda.router.replica import Replica
from pagoda.router.tenancy import TenantMeter

logger = logging.getLogger("pagoda.route")

SPLIT_PATHS = ("/v1/completions", "/v1/chat/completions")
# What the prefill step does not need: it samples one token, thrown away, and answers whole.
PREFILL_DROPPED = ("stream", "stream_options", "n", "best_of", "min_tokens", "stop", "max_completion_tokens",
                   "logprobs", "top_logprobs", "kv_transfer_params")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill replica's request: the same prompt (every field that shapes it kept), one token, held KV."""
    prefill = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    prefill["max_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def disaggregated_routers(decode: Sequence[str], prefill: Sequence[str], config: RouterConfig,
                          event_endpoints: Mapping[str, str] | None = None) -> tuple[Router, Router]:
    """(the decode pool's Router, the prefill pool's), sharing one metrics registry: the router's /metrics then
    shows both pools and the split's counters."""
    pools: dict[str, Router] = {}

    def members(name: str) -> Callable[[], list[Replica]]:
        return lambda: pools[name].replicas

    metrics = RouterMetrics(lambda: [r for pool in pools.values() for r in pool.replicas], time.monotonic,
                            pools={name: members(name) for name in ("prefill", "decode")})
    endpoints = dict(event_endpoints or {})
    for name, urls in (("decode", decode), ("prefill", prefill)):
        pools[name] = Router(urls, config, event_endpoints={u: e for u, e in endpoints.items() if u in urls},
                             metrics=metrics)
    return pools["decode"], pools["prefill"]


def splits(path: str, body: dict[str, Any]) -> bool:
    """Is this a request the split serves: one prompt's completion or chat completion?"""
    if path not in SPLIT_PATHS:
        return False
    if path == "/v1/completions":
        prompt = body.get("prompt")
        # A list of strings or of token lists is several prompts; a list of ints is one prompt's tokens.
        return isinstance(prompt, str) or (isinstance(prompt, list) and (
            len(prompt) == 1 or all(isinstance(token, int) for token in prompt)))
    return True


class DisaggregatedForwarder:
    """Forwarder's interface over two pools: `prefill` computes prompts, `decode` answers."""

    def __init__(self, prefill: Forwarder, decode: Forwarder, metrics: RouterMetrics) -> None:
        """metrics: where the split counts its pools' requests, transfers and fallbacks (disaggregated_routers'
        shared registry; a registry without them counts nothing)."""
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics

    def _count(self, pool: str) -> None:
        if self.metrics.pool_requests is not None:
            self.metrics.pool_requests.labels(pool).inc()

    async def dispatch(self, path: str, body: bytes, headers: dict[str, str], prompt: RoutedPrompt,
                       stream: bool, pinned: Replica | None = None, meter: TenantMeter | None = None) -> Response:
        """meter: the request's tenant, charged by the answer (the prefill step's one token is not its)."""
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if pinned is not None or not isinstance(parsed, dict) or not splits(path, parsed):
            self._count("decode")
            return await self.decode.dispatch(path, body, headers, prompt, stream, pinned, meter)
        self._count("prefill")
        transfer = await self._prefill(path, parsed, headers, prompt)
        if transfer is not None:
            body = json.dumps({**parsed, "kv_transfer_params": transfer}).encode()
            if self.metrics.transfers is not None:
                self.metrics.transfers.inc()
        self._count("decode")
        return await self.decode.dispatch(path, body, headers, prompt, stream, meter=meter)

    def _fell_back(self, reason: str) -> None:
        if self.metrics.fallbacks is not None:
            self.metrics.fallbacks.labels(reason).inc()

    async def _prefill(self, path: str, parsed: dict[str, Any], headers: dict[str, str],
                       prompt: RoutedPrompt) -> dict[str, Any] | None:
        """The prefill replica's kv_transfer_params, or None when the prefill step failed in any way (the decode
        replica then computes the prompt, and answers a bad request's error itself)."""
        answer = await self.prefill.dispatch(path, json.dumps(prefill_request(parsed)).encode(), headers, prompt,
                                             stream=False)
        if answer.status_code != 200:
            logger.info("prefill step answered %d: the decode replica computes the prompt", answer.status_code)
            # 503: no prefill replica up (or none answered); anything else, the replica's error answer.
            self._fell_back("no_prefill_replica" if answer.status_code == 503 else "prefill_error")
            return None
        try:
            transfer = json.loads(bytes(answer.body)).get("kv_transfer_params")
        except (ValueError, AttributeError):
            transfer = None
        if not isinstance(transfer, dict) or not transfer.get("do_remote_prefill"):
            logger.warning("the prefill replica answered without kv_transfer_params (is it serving with "
                           "--kv-transfer-config's TcpConnector as kv_producer?): the decode replica computes")
            self._fell_back("no_kv_transfer_params")
            return None
        return transfer
