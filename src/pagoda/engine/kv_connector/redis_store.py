"""The shared tier: KV blocks in Redis (or Valkey), read and written by every replica of a model.

Every call waits at most `timeout_s` (the socket's connect and read timeouts; redis-py's own retries off). A
call that fails marks the store down for a backoff that doubles while it keeps failing, up to a bound; while
down, calls answer "nothing here" at once without touching the network, so a dead store costs a step nothing
after the first timeout. The first call after the backoff tries again; its success resets the backoff (the
store is back: hits resume). Keys are `prefix + key` (binary); values are block_format's. Eviction is Redis's
own (`maxmemory` with an LRU policy: deploy/k8s/kv-store.yaml), and `ttl_s` lets each block expire that long after
it was last stored; shared_evictions.py reports both as KV events. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagoda.engine.kv_connector.counters import TierCounters
from pagoda.engine.kv_connector.shared_evictions import SharedTierEvictions

logger = logging.getLogger(__name__)

T = TypeVar("T")
KEY_PREFIX = b"pagoda:kv:"


class RedisStore:
    def __init__(self, url: str, medium: str, timeout_s: float, backoff_s: float, max_backoff_s: float,
                 ttl_s: float | None = None, evictions: SharedTierEvictions | None = None,
                 counters: TierCounters | None = None) -> None:
        self.medium = medium
        self.ttl_s = ttl_s
        self.evictions = evictions  # told each key stored, so that its loss is reported
        self.event_order: AbstractContextManager[object] = (
            contextlib.nullcontext() if evictions is None else evictions.event_order)
        self.counters = counters or TierCounters(medium)
        self.url = url
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False, health_check_interval=0,
        )
        self._initial_backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._backoff_s = backoff_s
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def exists() -> list[int]:
            pipeline = self._client.pipeline(transaction=False)
            for key in keys:
                pipeline.exists(KEY_PREFIX + key)
            return [int(found) for found in pipeline.execute()]

        no_answer: list[int] = []
        found = self._call(exists, no_answer)
        count = 0
        for present in found:
            if not present:
                break
            count += 1
        return count

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda: list(self._client.mget([KEY_PREFIX + key for key in keys])), None)
        if values is None:
            return [None] * len(keys)
        return [value if isinstance(value, bytes) else None for value in values]

    def put(self, key: bytes, value: bytes) -> bool:
        expiry_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        stored = self._call(lambda: bool(self._client.set(KEY_PREFIX + key, value, px=expiry_ms)), False)
        if stored and self.evictions is not None:
            self.evictions.track(key)
        return stored

    def close(self) -> None:
        if self.evictions is not None:
            self.evictions.close()
        self._client.close()

    def _call(self, operation: Callable[[], T], fallback: T) -> T:
        if self.is_down:
            return fallback
        try:
            result = operation()
        except (redis.RedisError, OSError) as error:
            with self._lock:
                first = self._backoff_s == self._initial_backoff_s
                self._down_until = time.monotonic() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, self._max_backoff_s)
            self.counters.add(failures=1)
            if first:
                logger.warning("KV store %s unavailable (%s): bypassed, retried with backoff", self.url, error)
            return fallback
        if self._backoff_s != self._initial_backoff_s:
            with self._lock:
                self._backoff_s = self._initial_backoff_s
            logger.info("KV store %s is back", self.url)
            if self.evictions is not None:
                self.evictions.reconcile_soon()  # it may have come back empty
        return result
