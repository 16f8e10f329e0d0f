"""The router's state and decisions, without any I/O: the proxy and the simulation tests drive the same object.

`choose` picks a replica for a prompt (or says why none can take it), `begin` records the decision (load and
index), and the returned `Lease` is finished on every path the request can take: success, error, retry,
client disconnect. What a replica reports back (how an attempt ended, its cached tokens, a restart) goes
through the `record_*` / `observe_*` methods; `router/faults.py` says what each outcome means.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pagoda.router.config import RouterConfig
from pagoda.router.faults import Outcome
from pagoda.router.index import BlockIndex
from pagoda.router.metrics import RouterMetrics
from pagoda.router.policies import RoutedPrompt, RoutingPolicy, make_policy
from pagoda.router.replica import PolledStats, Replica

# As many response ids as a replica keeps (server/responses.py's MAX_STORED_RESPONSES), times a fleet's worth.
MAX_REMEMBERED_RESPONSES = 65536


class NoReplicaAvailable(Exception):
    """No replica can take the request: 503 when none is up, 429 (with Retry-After) when all are saturated."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Decision:
    replica: Replica
    prompt: RoutedPrompt
    matched_blocks: int  # leading blocks of the prompt the replica's index holds

    @property
    def expected_hit_tokens(self) -> int:
        return self.matched_blocks * self.replica.block_size


@dataclass
class Lease:
    """One request in flight on one replica, as the router counts it. Its load is the work it brings: the
    prompt tokens the replica must compute (hits are nearly free) until its first output arrives (the prefill
    is then done), then each output token as it streams. `finish` is idempotent."""

    decision: Decision
    prefix_key: int | None
    new_blocks: list[int]  # blocks this request put into the index (forgotten if it fails)
    prefill_tokens: int
    output_tokens: int = 0
    finished: bool = field(default=False)

    def first_output(self) -> None:
        """The replica has computed the prompt: its prefill no longer weighs on the replica."""
        if not self.finished:
            self.decision.replica.active_tokens -= self.prefill_tokens
            self.prefill_tokens = 0

    def add_output_tokens(self, count: int) -> None:
        if not self.finished:
            self.output_tokens += count
            self.decision.replica.active_tokens += count

    def finish(self, succeeded: bool = True) -> None:
        if self.finished:
            return
        self.finished = True
        replica = self.decision.replica
        replica.active_requests -= 1
        replica.active_tokens -= self.prefill_tokens + self.output_tokens
        if self.prefix_key is not None:
            remaining = replica.active_by_prefix[self.prefix_key] - 1
            if remaining:
                replica.active_by_prefix[self.prefix_key] = remaining
            else:
                del replica.active_by_prefix[self.prefix_key]
        if not succeeded:  # the replica may never have computed the prompt
            replica.index.forget(self.new_blocks)


class Router:
    def __init__(self, urls: Sequence[str], config: RouterConfig, policy: RoutingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, event_endpoints: Mapping[str, str] | None = None,
                 metrics: RouterMetrics | None = None) -> None:
        """event_endpoints: replica URL -> where it publishes KV events, for the replicas that do. metrics: a
        registry shared with another pool's Router (--pd-disaggregation); by default this Router's own."""
        urls = [url.rstrip("/") for url in urls]
        if not urls:
            raise ValueError("a router needs at least one replica")
        if len(set(urls)) != len(urls):
            raise ValueError("replica URLs must be distinct")
        endpoints = {url.rstrip("/"): endpoint for url, endpoint in (event_endpoints or {}).items()}
        unknown = sorted(set(endpoints) - set(urls))
        if unknown:
            raise ValueError(f"KV event endpoints given for URLs that are not replicas: {', '.join(unknown)}")
        self.config = config
        self.replicas = [Replica(url, config, endpoints.get(url)) for url in urls]
        # What the replicas' shared KV store holds, from any replica's events: one index, every replica's hit.
        self.shared_index = BlockIndex(config.index_ttl_s, config.index_max_blocks)
        for replica in self.replicas:
            replica.shared_index = self.shared_index
        self.policy = policy or make_policy(config)
        self.clock = clock
        self.metrics = metrics or RouterMetrics(lambda: self.replicas, clock)
        # Which replica answered each recent /v1/responses call: a continuation (previous_response_id) needs
        # the replica that stored it. Bounded, oldest forgotten first, as the replicas' own stores are.
        self.response_owners: OrderedDict[str, Replica] = OrderedDict()

    # --- decisions ---------------------------------------------------------------------------------

    def choose(self, prompt: RoutedPrompt, exclude: Sequence[Replica] = (), pinned: Replica | None = None) -> Decision:
        """pinned: the one replica that can serve the request (it holds state the others lack)."""
        now = self.clock()
        up = [r for r in self.replicas if r not in exclude and r.routable(now) and pinned in (None, r)]
        # Adapter affinity: a request naming an adapter goes to a replica that serves it, when one is up (the
        # policy chooses among them); one that names no adapter any replica lists goes anywhere.
        holders = [r for r in up if prompt.model is not None and prompt.model in r.adapters]
        up = holders or up
        if not up:
            self.metrics.rejected.labels("503").inc()
            if pinned is not None:
                raise NoReplicaAvailable(503, f"the replica that holds this request's earlier response "
                                              f"({pinned.url}) is not available")
            raise NoReplicaAvailable(503, "no replica is available (all are down or ejected)")
        candidates = [r for r in up if not r.saturated(now)]
        if not candidates:
            self.metrics.rejected.labels("429").inc()
            waits = [r.saturated_until - now for r in up if r.saturated_until > now]
            retry_after = min(waits) if len(waits) == len(up) else self.config.retry_after_s
            raise NoReplicaAvailable(429, "every replica is saturated; retry later", max(retry_after, 0.0))
        replica = self.policy.choose(prompt, candidates, now)
        matched = replica.match(prompt.cacheable(replica.block_size), now)
        return Decision(replica, prompt, matched)

    def adapters(self) -> frozenset[str]:
        """Every adapter some replica lists."""
        return frozenset().union(*(r.adapters for r in self.replicas))

    def begin(self, decision: Decision) -> Lease:
        """Counts the request on its replica and records its blocks there (the replica will cache them)."""
        replica, prompt = decision.replica, decision.prompt
        # A replica publishing events says itself what it caches; for the others, the router's guess.
        blocks = [] if replica.learns_from_events else prompt.block_hashes(replica.block_size)
        replica.index.insert(blocks, self.clock())
        key = prompt.prefix_key(replica.block_size)
        work_tokens = prompt.num_tokens - decision.expected_hit_tokens
        replica.active_requests += 1
        replica.routed_requests += 1
        replica.active_tokens += work_tokens
        if key is not None:
            replica.active_by_prefix[key] = replica.active_by_prefix.get(key, 0) + 1
        labels = replica.url
        self.metrics.requests.labels(labels).inc()
        self.metrics.prompt_tokens.labels(labels).inc(prompt.num_tokens)
        self.metrics.expected_hit_tokens.labels(labels).inc(decision.expected_hit_tokens)
        return Lease(decision, key, blocks[decision.matched_blocks:], work_tokens)

    # --- what replicas report ----------------------------------------------------------------------

    def record_outcome(self, replica: Replica, outcome: Outcome, retry_after_s: float | None = None) -> None:
        """How an attempt on the replica ended (retry_after_s: a 429's Retry-After, if it had one)."""
        if outcome is Outcome.ANSWERED:
            self.record_success(replica)
        elif outcome is Outcome.SATURATED:
            self.record_saturated(replica, retry_after_s)
        elif outcome.is_failure:
            self.record_failure(replica, outcome)
        # REQUEST_FAULT: the request's own; it tells nothing about the replica

    def record_success(self, replica: Replica) -> None:
        replica.breaker.record_success()

    def record_failure(self, replica: Replica, outcome: Outcome = Outcome.CONNECTION) -> None:
        """No answer, or a replica-wide error answer: counts toward the replica's circuit breaker, which opens
        (an ejection) at its threshold, unless the outcome was an answer and no other replica is up."""
        now = self.clock()
        others_up = any(r is not replica and r.routable(now) for r in self.replicas)
        may_open = outcome.may_eject_last_replica or others_up
        if replica.breaker.record_failure(now, may_open):
            self.metrics.ejections.labels(replica.url).inc()

    def record_saturated(self, replica: Replica, retry_after_s: float | None) -> None:
        """A 429: the replica is skipped until its Retry-After has passed. Not a failure."""
        wait = retry_after_s if retry_after_s is not None else self.config.retry_after_s
        replica.saturated_until = max(replica.saturated_until, self.clock() + wait)

    def record_retry(self, replica: Replica, reason: str) -> None:
        self.metrics.retries.labels(replica.url, reason).inc()

    def observe_cached_tokens(self, decision: Decision, cached_tokens: int) -> None:
        """The replica's own count of prompt tokens it served from cache (usage.prompt_tokens_details). None of
        the blocks the router expected: the replica lost its cache (a reset, a restart between polls), so the
        index keeps only this prompt, which the replica has just computed. Some of them: evicted there, and
        recomputed by this very request, so the index is right again."""
        replica = decision.replica
        if replica.learns_from_events:
            return
        if decision.matched_blocks > 0 and cached_tokens < replica.block_size:
            self.reset_index(replica)
            replica.index.insert(decision.prompt.block_hashes(replica.block_size), self.clock())

    def remember_response(self, response_id: str, replica: Replica) -> None:
        self.response_owners[response_id] = replica
        self.response_owners.move_to_end(response_id)
        while len(self.response_owners) > MAX_REMEMBERED_RESPONSES:
            self.response_owners.popitem(last=False)

    def set_health(self, replica: Replica, healthy: bool) -> None:
        if not healthy and replica.healthy:
            self.reset_index(replica)  # it may come back restarted, with an empty cache
        replica.healthy = healthy

    def update_stats(self, replica: Replica, stats: PolledStats) -> None:
        if replica.update_stats(stats):
            self.reset_index(replica)

    def reset_index(self, replica: Replica) -> None:
        """Forgets what the replica itself holds (its KV pool and its offload tier; the shared store stays)."""
        replica.index.clear()
        replica.offload_index.clear()
        self.metrics.index_resets.labels(replica.url).inc()
