"""The shared tier's losses as KV events: a block that Redis evicts (maxmemory LRU), lets expire (`store_ttl_s`) or
loses (a store restarted empty, flushed) is published as `BlockRemoved` with the shared medium, so the router stops
counting it as a hit on every replica.

Redis tells its subscribers of evictions and expiries (keyspace notifications, `notify-keyspace-events` with
`E`, `e` and `x`: turned on here when the server allows CONFIG, else set in the store's own configuration). A
restart, a flush, or notifications missed while disconnected tell nothing; so on every (re)subscription and
every `reconcile_interval_s` the keys this replica stored are checked and the missing ones are reported.

Only the blocks this replica stored are reported (it published their `BlockStored`); replicas that stored the
same block each report it, and the router's index forgets idempotently. Torch-free; a thread of its own, which
never touches the engine's stores' connections.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import redis

from pagoda.engine.kv_connector.keys import block_hash_of

logger = logging.getLogger(__name__)

NOTIFY_FLAGS = "Exe"  # keyevent channel, expired, evicted
RECONCILE_BATCH = 1024

Removed = Callable[[list[bytes]], None]  # block hashes gone from the store


class SharedTierEvictions:
    """Follows one Redis store's evictions of the keys (without `key_prefix`) passed to `track`; calls `removed`
    with their block hashes, from its own thread. `max_tracked` bounds memory: the oldest keys are forgotten
    (the router's index has the same default capacity bound)."""

    def __init__(self, url: str, key_prefix: bytes, removed: Removed, timeout_s: float,
                 reconcile_interval_s: float = 30.0, max_tracked: int = 1 << 16) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.removed = removed
        self.timeout_s = timeout_s
        self.reconcile_interval_s = reconcile_interval_s
        self.max_tracked = max_tracked
        self.notifications = False  # whether the server sends evictions (else: reconciliation only)
        self._tracked: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        # The saving thread holds it across a put and its BlockStored event (KVStore.event_order); a removal is
        # decided and published under it, so it never overtakes the store it undoes.
        self.event_order = threading.Lock()
        self._stop = threading.Event()
        self._reconcile_now = threading.Event()
        self._db = int(redis.ConnectionPool.from_url(url).connection_kwargs.get("db", 0) or 0)
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-shared-evictions", daemon=True)
        self._thread.start()

    def track(self, key: bytes) -> None:
        with self._lock:
            self._tracked[key] = None
            self._tracked.move_to_end(key)
            while len(self._tracked) > self.max_tracked:
                self._tracked.popitem(last=False)

    def num_tracked(self) -> int:
        with self._lock:
            return len(self._tracked)

    def reconcile_soon(self) -> None:
        """Checks the tracked keys at once (the store came back after being unreachable)."""
        self._reconcile_now.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # --- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                self._follow()
            except (redis.RedisError, OSError) as error:
                logger.debug("shared KV store %s: evictions not followed (%s), retrying", self.url, error)
            self._stop.wait(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)

    def _follow(self) -> None:
        commands = redis.Redis.from_url(self.url, socket_timeout=self.timeout_s,
                                        socket_connect_timeout=self.timeout_s)
        # No read timeout on the subscription: it waits for messages; a dead server ends it with an error.
        listener = redis.Redis.from_url(self.url, socket_connect_timeout=self.timeout_s)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        try:
            self.notifications = self._enable_notifications(commands)
            pubsub.subscribe(*(f"__keyevent@{self._db}__:{kind}" for kind in ("evicted", "expired")))
            self._reconcile(commands)  # what went missing while nobody listened
            while not self._stop.is_set():
                waited = 0.0
                while waited < self.reconcile_interval_s and not self._stop.is_set() \
                        and not self._reconcile_now.is_set():
                    message = pubsub.get_message(timeout=0.1)
                    if message is None:
                        waited += 0.1
                        continue
                    data = message.get("data")
                    if isinstance(data, bytes) and data.startswith(self.key_prefix):
                        self._forget([data[len(self.key_prefix):]])
                self._reconcile_now.clear()
                if not self._stop.is_set():
                    self._reconcile(commands)
        finally:
            pubsub.close()
            listener.close()
            commands.close()

    def _enable_notifications(self, client: redis.Redis) -> bool:
        try:
            flags = str(client.config_get("notify-keyspace-events").get("notify-keyspace-events", ""))
            if "E" in flags and ("A" in flags or ("e" in flags and "x" in flags)):
                return True
            merged = "".join(sorted(set(flags + NOTIFY_FLAGS)))
            client.config_set("notify-keyspace-events", merged)
            return True
        except redis.ResponseError as error:  # CONFIG refused (a managed store): reconciliation only
            logger.warning("shared KV store %s: cannot turn on eviction notifications (%s); evictions are found "
                           "every %.0f s instead: set notify-keyspace-events %s on the store", self.url, error,
                           self.reconcile_interval_s, NOTIFY_FLAGS)
            return False

    def _reconcile(self, client: redis.Redis) -> None:
        with self._lock:
            keys = list(self._tracked)
        for start in range(0, len(keys), RECONCILE_BATCH):
            batch = keys[start : start + RECONCILE_BATCH]
            with self.event_order:  # a key stored again meanwhile would be found, not reported
                pipeline = client.pipeline(transaction=False)
                for key in batch:
                    pipeline.exists(self.key_prefix + key)
                present = pipeline.execute()
                self._forget_ordered([key for key, found in zip(batch, present) if not found])

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self.event_order:
            self._forget_ordered(keys)

    def _forget_ordered(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            gone = [key for key in keys if key in self._tracked]
            for key in gone:
                del self._tracked[key]
        if gone:
            self.removed([block_hash_of(key) for key in gone])
