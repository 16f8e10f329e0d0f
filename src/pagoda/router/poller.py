"""Health and load polling: every replica's /health, /metrics and /v1/models, every poll interval.

/health 200 means up. /metrics gives the load gauges (vllm:num_requests_waiting, vllm:kv_cache_usage_perc),
the block size (vllm:cache_config_info, as vLLM labels it) and a counter whose going back means a restart.
/v1/models lists the LoRA adapters the replica serves (the cards with a `parent`, as vLLM writes them), which
requests naming an adapter prefer. Replicas that check keys answer both only to the router's own key
(--replica-api-key).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagoda.router.core import Router
from pagoda.router.replica import PolledStats, Replica

logger = logging.getLogger("pagoda.route")

POLLED_PATHS = ("/health", "/metrics", "/v1/models")


class PollRequestsAtDebug(logging.Filter):
    """Installed on httpx's logger, which logs every request at INFO: the polls (two a replica every poll
    interval) become DEBUG records, so that an idle router's log says only what changes."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        url = args[1] if isinstance(args, tuple) and len(args) > 1 else None
        if getattr(url, "path", None) not in POLLED_PATHS:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


POLL_LOG_FILTER = PollRequestsAtDebug()


def parse_stats(text: str) -> PolledStats:
    """The gauges the router uses, summed over a replica's label sets (one per served model), and the KV blocks
    each tenant holds there."""
    values: dict[str, float] = {}
    block_size = num_blocks = None
    tenant_blocks: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagoda:tenant_kv_blocks" and "tenant" in sample.labels:
                tenant_blocks[sample.labels["tenant"]] = sample.value
            elif sample.name == "vllm:cache_config_info":
                block_size = _int_label(sample.labels, "block_size") or block_size
                num_blocks = _int_label(sample.labels, "num_gpu_blocks") or num_blocks
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return PolledStats(
        num_waiting=values.get("vllm:num_requests_waiting", 0.0),
        kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0),
        block_size=block_size, num_blocks=num_blocks,
        prefix_cache_queries=values.get("vllm:prefix_cache_queries_total", 0.0),
        tenant_kv_blocks=tuple(sorted(tenant_blocks.items())),
    )


def parse_adapters(document: object) -> frozenset[str] | None:
    """The adapters of a /v1/models answer: its cards with a parent; None for an answer of another shape."""
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(card["id"] for card in data
                     if isinstance(card, dict) and isinstance(card.get("id"), str) and card.get("parent"))


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(labels.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


async def poll_replica(router: Router, replica: Replica, client: httpx.AsyncClient) -> None:
    timeout = router.config.poll_timeout_s
    try:
        health = await client.get(f"{replica.url}/health", timeout=timeout)
        healthy = health.status_code == 200
        if healthy:
            metrics = await client.get(f"{replica.url}/metrics", timeout=timeout)
            if metrics.status_code == 200:
                router.update_stats(replica, parse_stats(metrics.text))
            models = await client.get(f"{replica.url}/v1/models", timeout=timeout)
            adapters = parse_adapters(models.json()) if models.status_code == 200 else None
            if adapters is not None:
                replica.adapters = adapters
    except (httpx.HTTPError, ValueError) as error:  # unreachable, or a /metrics that is not Prometheus text
        logger.debug("poll of %s failed: %s", replica.url, error)
        healthy = False
    if healthy != replica.healthy:
        if healthy:
            logger.info("replica %s is up", replica.url)
        else:
            logger.warning("replica %s is down", replica.url)
    router.set_health(replica, healthy)


async def poll_forever(router: Router, client: httpx.AsyncClient) -> None:
    while True:
        await asyncio.gather(*(poll_replica(router, r, client) for r in router.replicas))
        await asyncio.sleep(router.config.poll_interval_s)
