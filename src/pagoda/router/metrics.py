"""The router's own Prometheus metrics (`pagoda_router_*`), per replica where it matters."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from pagoda.router.replica import Replica


class _ReplicaGauges:
    """Read at scrape time from the replicas' state."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], clock: Callable[[], float]) -> None:
        self.replicas = replicas
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas, now = self.replicas(), self.clock()
        gauges: tuple[tuple[str, str, Callable[[Replica], float]], ...] = (
            ("pagoda_router_replica_up", "1 while the replica is healthy and not ejected.",
             lambda r: float(r.routable(now))),
            ("pagoda_router_replica_saturated", "1 while the replica is skipped as saturated.",
             lambda r: float(r.saturated(now))),
            ("pagoda_router_active_requests", "Requests the router has in flight on the replica.",
             lambda r: float(r.active_requests)),
            ("pagoda_router_index_blocks", "Blocks the router believes the replica's prefix cache holds.",
             lambda r: float(len(r.index))),
            ("pagoda_router_replica_block_size", "The block size prompts are hashed with for the replica.",
             lambda r: float(r.block_size)),
        )
        for name, doc, value_of in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica in replicas:
                gauge.add_metric([replica.url], value_of(replica))
            yield gauge
        tenant_blocks: dict[str, float] = {}
        for replica in replicas:
            for tenant, blocks in replica.stats.tenant_kv_blocks:
                tenant_blocks[tenant] = tenant_blocks.get(tenant, 0.0) + blocks
        held = GaugeMetricFamily("pagoda:tenant_kv_blocks", "KV blocks the tenant's running requests hold on all "
                                 "the replicas together, as last polled.", labels=["tenant"])
        for tenant, blocks in sorted(tenant_blocks.items()):
            held.add_metric([tenant], blocks)
        yield held
        active = [r.active_requests for r in replicas]
        imbalance = GaugeMetricFamily("pagoda_router_imbalance",
                                      "Most requests in flight on one replica over the mean (1: even; 0: idle).")
        mean = sum(active) / len(active) if active else 0.0
        imbalance.add_metric([], max(active) / mean if mean else 0.0)
        yield imbalance


class _PoolGauges:
    """--pd-disaggregation: each pool's replicas, and how many of them are up, at scrape time."""

    def __init__(self, pools: Mapping[str, Callable[[], Sequence[Replica]]], clock: Callable[[], float]) -> None:
        self.pools = pools
        self.clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        replicas = GaugeMetricFamily("pagoda_router_pool_replicas", "Replicas the pool lists.", labels=["pool"])
        up = GaugeMetricFamily("pagoda_router_pool_replicas_up", "Replicas of the pool that are healthy and not "
                                                                 "ejected.", labels=["pool"])
        for pool, members in self.pools.items():
            listed = members()
            replicas.add_metric([pool], float(len(listed)))
            up.add_metric([pool], float(sum(r.routable(now) for r in listed)))
        yield replicas
        yield up


class RouterMetrics:
    """pools: with --pd-disaggregation, each pool's replicas by name ("prefill", "decode"): one registry then serves
    both pools' Routers (the per-replica series of both, labelled by URL) and the split's own counters."""

    def __init__(self, replicas: Callable[[], Sequence[Replica]], clock: Callable[[], float],
                 pools: Mapping[str, Callable[[], Sequence[Replica]]] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ReplicaGauges(replicas, clock))
        if pools is not None:
            self.registry.register(_PoolGauges(pools, clock))

        def counter(name: str, doc: str, labels: Sequence[str] = ("replica",)) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry)

        self.requests = counter("pagoda_router_requests", "Requests sent to the replica (retries included).")
        self.prompt_tokens = counter("pagoda_router_prompt_tokens", "Prompt tokens routed to the replica.")
        self.expected_hit_tokens = counter("pagoda_router_expected_hit_tokens",
                                           "Prompt tokens the router expected the replica's prefix cache to hold.")
        self.retries = counter("pagoda_router_retries", "Requests retried on another replica after this one "
                                                        "failed or refused, by reason.", ("replica", "reason"))
        self.ejections = counter("pagoda_router_ejections", "Times the replica's circuit breaker opened.")
        self.index_resets = counter("pagoda_router_index_resets",
                                    "Times the replica's index was dropped (restart, cache reset, outage).")
        self.rejected = counter("pagoda_router_rejected", "Requests the router answered itself, by status.",
                                ("status",))
        self.event_gaps = counter("pagoda_router_kv_event_gaps", "KV event batches lost (sequence gaps).")
        self.pool_requests = self.transfers = self.fallbacks = None
        if pools is not None:
            self.pool_requests = counter("pagoda_router_pool_requests", "Requests the router sent to the pool: "
                                         "prefill steps, and every request answered by a decode replica.", ("pool",))
            self.transfers = counter("pagoda_router_pd_transfers", "Requests sent to a decode replica with a prefill "
                                     "replica's kv_transfer_params: their prompt's KV is pulled, not computed.", ())
            self.fallbacks = counter("pagoda_router_pd_fallbacks", "Split requests whose prefill step failed, by "
                                     "reason: the decode replica computed their prompt.", ("reason",))

    def render(self) -> bytes:
        return generate_latest(self.registry)
