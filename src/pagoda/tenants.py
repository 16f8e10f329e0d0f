"""Tenants: who a request is for, and the limits that tenant's requests meet at the door.

A tenants file (`--tenant-config`, JSON, reloaded on SIGHUP) names each tenant with its API keys, or a header a
trusted gateway in front sets (`tenant_header`), and per tenant: requests and tokens per minute (token buckets;
the request bucket holds a minute's worth unless `request_burst` makes it smaller),
its weight in the engine's fair queuing among tenants, the LoRA adapters it may name (absent: all), and whether
it shares the prefix cache with the others (by default its blocks are its own: its requests' cache salt is
prefixed with its name, so no other tenant can hit them or time them). A tenant's keys are API keys beside
`--api-key` / `--api-key-file`; a request that names no tenant belongs to the tenant named "default" if there
is one, else to none (no limits).

Neither the server's nor the router's: it imports neither.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"
_TENANT_KEYS = ("api_keys", "requests_per_minute", "request_burst", "tokens_per_minute", "weight", "max_kv_blocks",
                "adapters", "share_prefix_cache")
_FILE_KEYS = ("tenants", "tenant_header")


@dataclass(frozen=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...] = ()
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # prompt and generated tokens together; None: no limit
    weight: float = 1.0  # its share of the engine's tokens while tenants compete (fair queuing)
    max_kv_blocks: int | None = None  # holding more, its requests are the first preempted; None: no quota
    adapters: tuple[str, ...] | None = None  # the LoRA adapters it may name; None: every one
    share_prefix_cache: bool = False
    request_burst: int | None = None  # the most requests admitted at once (None: requests_per_minute)

    def cache_salt(self, salt: str | None) -> str | None:
        """The salt its requests' prefix-cache blocks are keyed with: its own namespace unless it shares."""
        if self.share_prefix_cache:
            return salt
        return f"tenant:{self.name}" + ("" if salt is None else f"|{salt}")

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


def _tenant(name: str, options: Any) -> Tenant:
    if not isinstance(options, Mapping):
        raise ValueError(f"tenant {name!r}: expected an object, got {type(options).__name__}")
    unknown = sorted(set(options) - set(_TENANT_KEYS))
    if unknown:
        raise ValueError(f"tenant {name!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_TENANT_KEYS)}")
    keys = options.get("api_keys", [])
    if not isinstance(keys, list) or any(not isinstance(k, str) or not k or k != k.strip() for k in keys):
        raise ValueError(f"tenant {name!r}: api_keys must be a list of non-empty keys without surrounding spaces")
    for limit in ("requests_per_minute", "request_burst", "tokens_per_minute", "max_kv_blocks"):
        value = options.get(limit)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"tenant {name!r}: {limit} must be a positive integer, got {value!r}")
    if options.get("request_burst") is not None and options.get("requests_per_minute") is None:
        raise ValueError(f"tenant {name!r}: request_burst needs requests_per_minute (the rate its bucket refills at)")
    weight = options.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise ValueError(f"tenant {name!r}: weight must be a positive number, got {weight!r}")
    adapters = options.get("adapters")
    if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
        raise ValueError(f"tenant {name!r}: adapters must be a list of adapter names")
    share = options.get("share_prefix_cache", False)
    if not isinstance(share, bool):
        raise ValueError(f"tenant {name!r}: share_prefix_cache must be true or false")
    return Tenant(name, tuple(keys), options.get("requests_per_minute"), options.get("tokens_per_minute"),
                  float(weight), options.get("max_kv_blocks"), None if adapters is None else tuple(adapters), share,
                  options.get("request_burst"))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class TenantTable:
    """The tenants file, parsed and checked. A key is found by its SHA-256 (a dict lookup on the digest tells a
    timing observer nothing about the key), then compared in constant time."""

    tenants: dict[str, Tenant] = field(default_factory=dict)
    header: str | None = None  # lower case, as ASGI gives header names
    _by_digest: dict[bytes, Tenant] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, document: Any) -> TenantTable:
        if not isinstance(document, Mapping):
            raise ValueError("the tenants file must hold a JSON object")
        unknown = sorted(set(document) - set(_FILE_KEYS))
        if unknown:
            raise ValueError(f"tenants file: unknown key(s) {', '.join(unknown)}; known: {', '.join(_FILE_KEYS)}")
        entries = document.get("tenants", {})
        if not isinstance(entries, Mapping):
            raise ValueError("tenants file: 'tenants' must map tenant names to their settings")
        tenants = {name: _tenant(name, options) for name, options in entries.items()}
        header = document.get("tenant_header")
        if header is not None and (not isinstance(header, str) or not header.strip()):
            raise ValueError("tenants file: tenant_header must be a header name")
        by_digest: dict[bytes, Tenant] = {}
        for tenant in tenants.values():
            for key in tenant.api_keys:
                owner = by_digest.setdefault(_digest(key.encode()), tenant)
                if owner is not tenant:
                    raise ValueError(f"tenants {owner.name!r} and {tenant.name!r} share an API key")
        return cls(tenants, header.strip().lower() if header else None, by_digest)

    @classmethod
    def load(cls, path: str | Path) -> TenantTable:
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"tenants file {path}: not valid JSON ({error})") from error
        return cls.parse(document)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for tenant in self.tenants.values() for key in tenant.api_keys)

    def of_key(self, key: bytes) -> Tenant | None:
        tenant = self._by_digest.get(_digest(key))
        if tenant is None or not any(hmac.compare_digest(key, k.encode()) for k in tenant.api_keys):
            return None
        return tenant

    def identify(self, headers: Mapping[str, str]) -> Tenant | None:
        """The request's tenant: the gateway's header when the file names one and the request carries it (an
        unknown name is a ValueError), else the owner of the bearer key, else "default" (or None)."""
        if self.header is not None and self.header in headers:
            name = headers[self.header]
            if name not in self.tenants:
                raise ValueError(f"unknown tenant {name!r} in header {self.header}")
            return self.tenants[name]
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        tenant = self.of_key(token.strip().encode()) if scheme.lower() == "bearer" else None
        return tenant if tenant is not None else self.tenants.get(DEFAULT_TENANT)


class TokenBucket:
    """`per_minute` units a minute, refilled continuously, holding at most `capacity` (a minute's worth unless
    smaller): what may be taken at once. Its level may go below zero: what a request is charged only after it is
    admitted (its generated tokens) is a debt that later requests wait out."""

    def __init__(self, per_minute: int, now: float, capacity: int | None = None) -> None:
        self.per_minute, self.capacity = per_minute, per_minute if capacity is None else capacity
        self.level, self.stamp = float(self.capacity), now

    def refill(self, now: float) -> float:
        self.level = min(float(self.capacity), self.level + (now - self.stamp) * self.per_minute / 60.0)
        self.stamp = now
        return self.level

    def seconds_until(self, level: float) -> float:
        """How long until the bucket holds `level` (after refill(now))."""
        return max(0.0, (level - self.level) * 60.0 / self.per_minute)

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass
class Refusal:
    """Why a tenant's request waits: which limit, and for how long."""

    limit: str  # "requests" or "tokens"
    retry_after: float


class TenantLimits:
    """Every tenant's two buckets. Reloading the file keeps the buckets of tenants whose limits are unchanged."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def _bucket(self, tenant: Tenant, limit: str, now: float) -> TokenBucket | None:
        per_minute = tenant.requests_per_minute if limit == "requests" else tenant.tokens_per_minute
        if per_minute is None:
            return None
        capacity = tenant.request_burst if limit == "requests" else None
        bucket = self._buckets.get((tenant.name, limit))
        if bucket is None or (bucket.per_minute, bucket.capacity) != (per_minute, capacity or per_minute):
            bucket = self._buckets[(tenant.name, limit)] = TokenBucket(per_minute, now, capacity)
        bucket.refill(now)
        return bucket

    def admit(self, tenant: Tenant, now: float) -> Refusal | None:
        """Takes one request from the tenant's request bucket, or says why not: a request needs one whole
        request left, and a token bucket not in debt (its tokens are charged as they are known)."""
        requests, tokens = self._bucket(tenant, "requests", now), self._bucket(tenant, "tokens", now)
        if requests is not None and requests.level < 1:
            return Refusal("requests", requests.seconds_until(1))
        if tokens is not None and tokens.level <= 0:
            return Refusal("tokens", tokens.seconds_until(1))
        if requests is not None:
            requests.take(1)
        return None

    def charge(self, tenant: Tenant, num_tokens: int, now: float) -> None:
        bucket = self._bucket(tenant, "tokens", now)
        if bucket is not None:
            bucket.take(num_tokens)

    def headers(self, tenant: Tenant, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits the tenant has."""
        headers: dict[str, str] = {}
        for limit in ("requests", "tokens"):
            bucket = self._bucket(tenant, limit, now)
            if bucket is None:
                continue
            headers[f"x-ratelimit-limit-{limit}"] = str(bucket.per_minute)
            headers[f"x-ratelimit-remaining-{limit}"] = str(max(0, math.floor(bucket.level)))
            headers[f"x-ratelimit-reset-{limit}"] = f"{bucket.seconds_until(bucket.capacity):.3g}s"
        return headers
