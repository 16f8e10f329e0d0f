"""The router's settings: every default once, here. `pagoda route` passes only the flags that were given.

Kept out of pagoda.config, the engine's: the router knows no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    # Cost of a replica, in tokens: hit_weight x uncached prompt tokens + the tokens of its requests in flight
    # + queue_weight_tokens x its vllm:num_requests_waiting + kv_weight_tokens x its vllm:kv_cache_usage_perc.
    # Above 1: a conversation that leaves the replica holding its history pays the whole history again now,
    # and splits its later turns' hits between two replicas.
    hit_weight: float = 2.0
    queue_weight_tokens: float = 256.0
    kv_weight_tokens: float = 256.0
    # A replica past either threshold (as last polled) is skipped; when all are, the router answers 429.
    max_waiting_requests: int = 64
    max_kv_usage: float = 0.95
    # No replica takes more than this share of one hot prefix's requests in flight, once at least
    # hot_prefix_min_inflight of them are in flight (a shared system prompt must not pile onto one replica).
    hot_prefix_share: float = 0.5
    hot_prefix_min_inflight: int = 4
    # The approximate index (what the router's own decisions put on each replica) forgets a block this long
    # after it was last routed or matched; capacity: the replica's num_gpu_blocks when it publishes it.
    index_ttl_s: float = 120.0
    index_max_blocks: int = 65536
    # The KV events medium of a store every replica reads (the replicas' offload shared tier): a block stored there
    # counts as cached on every replica. The replicas that stored a block report its eviction, expiry or loss;
    # index_ttl_s bounds an entry whose removal was lost.
    shared_kv_medium: str = "SHARED"
    default_block_size: int = 16  # until a replica's vllm:cache_config_info says otherwise
    # Health and load polling (/health and /metrics of every replica).
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 2.0
    # Circuit breaker: this many consecutive failures (no answer, or a replica-wide 5xx: router/faults.py) eject a
    # replica for the cooldown.
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    # Retries go to another replica, with jittered exponential backoff, only before any byte reached the client.
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    retry_after_s: float = 1.0  # Retry-After when every replica is saturated (and a replica's 429 without one)
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        for name in ("hit_weight", "queue_weight_tokens", "kv_weight_tokens", "index_ttl_s", "retry_backoff_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_waiting_requests", "index_max_blocks", "default_block_size", "breaker_failures",
                     "hot_prefix_min_inflight", "poll_interval_s", "poll_timeout_s", "retry_after_s",
                     "connect_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.hot_prefix_share <= 1 or not 0 < self.max_kv_usage <= 1:
            raise ValueError("hot_prefix_share and max_kv_usage must be in (0, 1]")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
