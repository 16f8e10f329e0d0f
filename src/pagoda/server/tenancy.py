"""The server's side of tenants: the door (pagoda/tenant_door.py: keys, who a request is for, its rate limits and
counters), what the engine learns of a request's tenant (its `TenantShare`), and what it tells back: the KV blocks
each tenant's requests hold, a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from pagoda.engine.api import EngineStats, TenantShare
from pagoda.tenant_door import TenantPass, Tenants

__all__ = ["TenantPass", "Tenants", "register_tenant_gauges", "tenant_share"]


def tenant_share(tenant_pass: TenantPass) -> TenantShare:
    """What the engine's fair queue knows of the tenant: its name, weight and KV quota."""
    tenant = tenant_pass.tenant
    return TenantShare(tenant.name, tenant.weight, tenant.max_kv_blocks)


class _TenantKVBlocks:
    """pagoda:tenant_kv_blocks{tenant}, read from the engine's stats at scrape time. One sample for each tenant
    of the file in force (0 while it holds none), and none for any other name: a tenant dropped by a reload
    leaves the gauge, so the label's cardinality is the file's."""

    def __init__(self, tenants: Tenants, stats: Callable[[], EngineStats]) -> None:
        self.tenants, self.stats = tenants, stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = dict(self.stats().kv_blocks_by_tenant)
        gauge = GaugeMetricFamily("pagoda:tenant_kv_blocks", "KV blocks the tenant's running requests hold (a "
                                  "shared prefix block counts for each of its requests, as max_kv_blocks counts).",
                                  labels=["tenant"])
        for name in self.tenants.table.tenants:
            gauge.add_metric([name], float(held.get(name, 0)))
        yield gauge


def register_tenant_gauges(registry: CollectorRegistry, tenants: Tenants, stats: Callable[[], EngineStats]) -> None:
    """The door's per-tenant counters, and the KV blocks each tenant holds."""
    tenants.register(registry)
    registry.register(_TenantKVBlocks(tenants, stats))
