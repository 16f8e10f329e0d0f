"""The door of tenants (pagoda/tenants.py), shared by whatever process is the front: `pagoda serve` alone, or the
router in front of replicas (`pagoda route --tenant-config`, and `pagoda serve --data-parallel-size`). It says
which keys open the door, who a request is for, admits it against its tenant's token buckets (429 with
Retry-After and OpenAI's x-ratelimit-* headers) and counts per-tenant metrics. All on the event loop, but for the
file's reload, which swaps one reference.

A door that does not enforce the limits (`enforce_limits=False`: a replica behind a front that does) still
identifies tenants, checks their adapters and counts their metrics; its buckets are never touched, so the limits
are counted once, in front, whatever the number of replicas.

Neither the server's nor the router's: it imports neither.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from pagoda.api_keys import ApiKeys
from pagoda.tenants import Tenant, TenantLimits, TenantTable
from pagoda.wire import ERROR_SCOPE_HEADER, REQUEST_SCOPE, OpenAIError

logger = logging.getLogger(__name__)

RATE_LIMIT_HEADERS = tuple(f"x-ratelimit-{part}-{limit}" for part in ("limit", "remaining", "reset")
                           for limit in ("requests", "tokens"))


@dataclass
class TenantPass:
    """One admitted request's tenant: what its tokens are charged to and the headers its answer carries."""

    tenant: Tenant
    door: Tenants

    def start(self, prompts: list[list[int]], salt: str | None) -> str | None:
        """Charges the prompts' tokens; returns the cache salt its requests run with (the tenant's namespace)."""
        self.charge(sum(map(len, prompts)), "prompt")
        return self.tenant.cache_salt(salt)

    def charge(self, num_tokens: int, kind: str) -> None:
        """Charges prompt ("prompt") or generated ("generation") tokens to the tenant's token bucket."""
        if num_tokens:
            if self.door.enforce_limits:
                self.door.limits.charge(self.tenant, num_tokens, time.monotonic())
            self.door.count_tokens(self.tenant.name, kind, num_tokens)

    def headers(self) -> dict[str, str]:
        """The state of its limits, for its answer (none when another process counts them)."""
        if not self.door.enforce_limits:
            return {}
        return self.door.limits.headers(self.tenant, time.monotonic())


class Tenants:
    """The tenants file in force (none: every request is untenanted) and its buckets. Also the API key check
    the guard makes: the `--api-key` keys and every tenant's keys."""

    def __init__(self, api_keys: ApiKeys, path: str | Path | None = None, *, enforce_limits: bool = True) -> None:
        self.base_keys, self.path = api_keys, Path(path) if path is not None else None
        self.table = TenantTable.load(self.path) if self.path is not None else TenantTable()
        self.limits = TenantLimits()
        self.enforce_limits = enforce_limits
        # per-tenant counters, in the process's registry once it is built (no request comes before)
        self._requests: Counter | None = None
        self._tokens: Counter | None = None
        self.keys = self._keys()

    @property
    def configured(self) -> bool:
        return self.path is not None

    def _keys(self) -> ApiKeys:
        if not self.table.keys:
            return self.base_keys
        keys = [key.decode() for key in self.base_keys.keys] + list(self.table.keys)
        return ApiKeys.gather(keys, environ={}, guard_metrics=self.base_keys.guard_metrics)

    def reload(self) -> bool:
        """Reads the file again (SIGHUP). A file that no longer parses leaves the tenants in force as they were."""
        if self.path is None:
            return False
        try:
            table = TenantTable.load(self.path)
        except (OSError, ValueError) as error:
            logger.error("tenants file %s not reloaded, the previous one stays in force: %s", self.path, error)
            return False
        self.table = table
        self.keys = self._keys()
        logger.info("tenants file %s reloaded: %d tenants", self.path, len(table.tenants))
        return True

    # the guard's KeyCheck: the keys in force now
    def guards(self, path: str) -> bool:
        return self.keys.guards(path)

    def accepts(self, authorization: bytes | str | None) -> bool:
        return self.keys.accepts(authorization)

    def enter(self, headers: Mapping[str, str], adapter: str | None) -> TenantPass | None:
        """The request's tenant, admitted: 403 for an unknown tenant or an adapter it may not use, 429 when it is
        over a limit (marked as the request's own: a router in front passes it back rather than trying another
        replica). None: the request is nobody's (no tenants, or none matched and no "default")."""
        try:
            tenant = self.table.identify(headers)
        except ValueError as error:
            raise OpenAIError(403, str(error)) from error
        if tenant is None:
            return None
        if adapter is not None and not tenant.may_use(adapter):
            raise OpenAIError(403, f"tenant {tenant.name!r} may not use the adapter `{adapter}`", "model")
        now = time.monotonic()
        refusal = self.limits.admit(tenant, now) if self.enforce_limits else None
        if refusal is not None:
            self.count_request(tenant.name, "rate_limited")
            headers = {"Retry-After": str(max(1, math.ceil(refusal.retry_after))), ERROR_SCOPE_HEADER: REQUEST_SCOPE,
                       **self.limits.headers(tenant, now)}
            raise OpenAIError(429, f"tenant {tenant.name!r} is over its {refusal.limit} per minute; retry in "
                                   f"{refusal.retry_after:.1f} s", headers=headers)
        self.count_request(tenant.name, "admitted")
        return TenantPass(tenant, self)

    def count_request(self, tenant: str, outcome: str) -> None:
        if self._requests is not None:
            self._requests.labels(tenant, outcome).inc()

    def count_tokens(self, tenant: str, kind: str, amount: int) -> None:
        if self._tokens is not None:
            self._tokens.labels(tenant, kind).inc(amount)

    def register(self, registry: CollectorRegistry) -> None:
        """pagoda:tenant_requests{tenant,outcome} and pagoda:tenant_tokens{tenant,kind}: the label takes only the
        names of the tenants file, so its cardinality is the operator's."""
        self._requests = Counter("pagoda:tenant_requests", "Requests by tenant: admitted or rate-limited (429).",
                                 ["tenant", "outcome"], registry=registry)
        self._tokens = Counter("pagoda:tenant_tokens", "Tokens charged to a tenant: prompt or generation.",
                               ["tenant", "kind"], registry=registry)
