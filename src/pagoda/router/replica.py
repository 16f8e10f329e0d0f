"""One replica as the router sees it: its health, its circuit breaker, its load and its block index.

Load has two sources: what the router itself has in flight there (exact, updated on every path a request
can take), and the replica's own gauges, as last polled (vllm:num_requests_waiting, vllm:kv_cache_usage_perc).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.router.config import RouterConfig
from pagoda.router.index import BlockIndex, match_any


class CircuitBreaker:
    """Opens after `threshold` consecutive failures (what `Outcome.is_failure` says: no answer, or a
    replica-wide error), for `cooldown_s`; then lets requests through again, and the first failure reopens it
    at once."""

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.consecutive_failures = 0
        self.open_until = 0.0

    def allows(self, now: float) -> bool:
        return now >= self.open_until

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, now: float, may_open: bool = True) -> bool:
        """Counts a failure; True when it (re)opens the breaker: an ejection. Not opened while `may_open` is
        False; the count stays, so the next failure that may open it does."""
        self.consecutive_failures += 1
        if may_open and self.consecutive_failures >= self.threshold and self.allows(now):
            self.open_until = now + self.cooldown_s
            return True
        return False


@dataclass(frozen=True)
class PolledStats:
    """A replica's own gauges and counters, from its /metrics."""

    num_waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None  # vllm:cache_config_info's block_size label
    num_blocks: int | None = None  # its num_gpu_blocks label
    prefix_cache_queries: float = 0.0  # a counter: when it goes down, the replica restarted
    tenant_kv_blocks: tuple[tuple[str, float], ...] = ()  # pagoda:tenant_kv_blocks, by tenant


@dataclass(eq=False)  # a replica is itself: compared (and hashed) by identity
class Replica:
    url: str
    config: RouterConfig
    # Where the replica publishes its KV events (None: it does not; its index is learnt from routing decisions).
    events_endpoint: str | None = None
    healthy: bool = False  # until its first health check answers 200 (the poller runs one at start)
    stats: PolledStats = field(default_factory=PolledStats)
    saturated_until: float = 0.0  # after a 429: skipped until its Retry-After has passed
    # What the router has in flight here: requests, their tokens (prompt + streamed output), and per hot-prefix
    # key, how many requests.
    active_requests: int = 0
    active_tokens: int = 0
    active_by_prefix: dict[int, int] = field(default_factory=dict)
    routed_requests: int = 0  # every request the router has sent here: ties go to the least used replica
    # The LoRA adapters its /v1/models lists (cards with a parent), as last polled: requests naming one prefer it.
    adapters: frozenset[str] = frozenset()
    index: BlockIndex = field(init=False)  # its KV pool (KV events' "GPU" medium, or the router's guesses)
    offload_index: BlockIndex = field(init=False)  # its local offload tier (KV events' "CPU" medium)
    # The store all replicas share (the router's one index, KV events' shared medium); None: none known.
    shared_index: BlockIndex | None = None
    breaker: CircuitBreaker = field(init=False)

    def __post_init__(self) -> None:
        ttl_s = math.inf if self.learns_from_events else self.config.index_ttl_s
        self.index = BlockIndex(ttl_s, self.config.index_max_blocks)
        self.offload_index = BlockIndex(ttl_s, self.config.index_max_blocks)
        self.breaker = CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooldown_s)

    @property
    def learns_from_events(self) -> bool:
        """Its index follows its KV events (exact) rather than the router's decisions (approximate)."""
        return self.events_endpoint is not None

    def match(self, block_keys: Sequence[int], now: float) -> int:
        """Leading blocks of the chain the replica would not compute: in its KV pool, its offload tier or the shared
        store (a shared block is a hit for every replica)."""
        indexes = [self.index, self.offload_index]
        if self.shared_index is not None:
            indexes.append(self.shared_index)
        return match_any(indexes, block_keys, now)

    @property
    def block_size(self) -> int:
        return self.stats.block_size or self.config.default_block_size

    def routable(self, now: float) -> bool:
        """Up: healthy and not ejected. (Saturation is separate: saturated replicas are up but full.)"""
        return self.healthy and self.breaker.allows(now)

    def saturated(self, now: float) -> bool:
        return (now < self.saturated_until or self.stats.num_waiting >= self.config.max_waiting_requests
                or self.stats.kv_usage >= self.config.max_kv_usage)

    def load_tokens(self) -> float:
        """The load part of the cost, in tokens."""
        return (self.active_tokens + self.config.queue_weight_tokens * self.stats.num_waiting
                + self.config.kv_weight_tokens * self.stats.kv_usage)

    def update_stats(self, stats: PolledStats) -> bool:
        """Takes a new poll; True when it shows the replica restarted (its counters went back), after which
        nothing it cached before can be assumed."""
        restarted = stats.prefix_cache_queries < self.stats.prefix_cache_queries
        block_size_changed = self.stats.block_size is not None and stats.block_size != self.stats.block_size
        self.stats = stats
        if stats.num_blocks:
            self.index.max_blocks = min(stats.num_blocks, self.config.index_max_blocks)
        return restarted or block_size_changed
