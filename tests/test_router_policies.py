"""The routing policies in a seeded simulation, no model and no HTTP: simulated replicas with a true prefix
cache (an LRU of block hashes, hits as the engine counts them), driven through the same Router object the
proxy uses, on a simulated clock. Covers the known failure modes: a shared system prompt that would pile
onto one replica, cache-miss storms, a stale index after a replica restarts or resets its cache, and a
replica that answers only 429."""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from pagoda.block_hash import hash_block_chain, max_cacheable_blocks
from pagoda.router.config import RouterConfig
from pagoda.router.core import NoReplicaAvailable, Router
from pagoda.router.index import BlockIndex
from pagoda.router.policies import RoutedPrompt
from pagoda.router.replica import PolledStats

BLOCK_SIZE = 16
POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


# --------------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------------


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimReplica:
    """A replica's prefix cache as the engine keeps it: full blocks, LRU, a fixed number of them."""

    capacity_blocks: int
    answers_429: bool = False
    cache: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    prompt_tokens: int = 0
    hit_tokens: int = 0
    served: int = 0
    refused: int = 0

    def run(self, token_ids: list[int], salt: str | None = None) -> int:
        """Serves a prompt (+ its output, already part of the next turn's tokens): returns its hit tokens."""
        chain = hash_block_chain(token_ids, BLOCK_SIZE, salt)
        hits = 0
        for block_hash in chain[: max_cacheable_blocks(len(token_ids), BLOCK_SIZE)]:
            if block_hash not in self.cache:
                break
            hits += 1
        for block_hash in chain:
            self.cache[block_hash] = None
            self.cache.move_to_end(block_hash)
        while len(self.cache) > self.capacity_blocks:
            self.cache.popitem(last=False)
        self.prompt_tokens += len(token_ids)
        self.hit_tokens += hits * BLOCK_SIZE
        self.served += 1
        return hits * BLOCK_SIZE

    def reset_cache(self) -> None:
        self.cache.clear()


class Simulation:
    """Requests arrive at given times, are routed, run for a time that grows with their uncached tokens, and
    finish (their lease ends). A refused request (429) is retried on another replica, as the proxy does."""

    def __init__(self, policy: str, num_replicas: int = 8, capacity_blocks: int = 512, **config) -> None:
        self.clock = SimClock()
        self.config = RouterConfig(policy=policy, default_block_size=BLOCK_SIZE, seed=1, **config)
        self.router = Router([f"http://replica-{i}" for i in range(num_replicas)], self.config, clock=self.clock)
        self.replicas = {r.url: SimReplica(capacity_blocks) for r in self.router.replicas}
        for replica in self.router.replicas:  # as the poller's first health check finds them
            self.router.set_health(replica, True)
        self._events: list[tuple[float, int, Callable[[], None]]] = []  # (time, order, what happens)
        self._sequence = 0
        self.mispredicted = 0  # requests whose expected hits the replica did not have

    def advance(self, until: float) -> None:
        while self._events and self._events[0][0] <= until:
            when, _, event = heapq.heappop(self._events)
            self.clock.now = when
            event()
        self.clock.now = until

    def _at(self, when: float, event: Callable[[], None]) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (when, self._sequence, event))

    def submit(self, token_ids: list[int], output_tokens: int = 32, salt: str | None = None) -> str:
        """Routes one request now; returns the replica that served it."""
        prompt = RoutedPrompt(token_ids, salt)
        tried = []
        while True:
            decision = self.router.choose(prompt, exclude=tried)
            replica = self.replicas[decision.replica.url]
            lease = self.router.begin(decision)
            if replica.answers_429:
                replica.refused += 1
                lease.finish(succeeded=False)
                self.router.record_saturated(decision.replica, 1.0)
                self.router.record_retry(decision.replica, "429")
                tried.append(decision.replica)
                continue
            break
        hit_tokens = replica.run(token_ids, salt)
        if hit_tokens < decision.expected_hit_tokens:
            self.mispredicted += 1
        self.router.observe_cached_tokens(decision, hit_tokens)  # what usage.cached_tokens reports
        prefill_done = self.clock.now + 0.002 * (len(token_ids) - hit_tokens)

        def first_output() -> None:
            lease.first_output()
            lease.add_output_tokens(output_tokens)  # the decode, as the replica streams it

        self._at(prefill_done, first_output)
        self._at(prefill_done + 0.01 * output_tokens, lease.finish)
        return decision.replica.url

    def drain(self) -> None:
        self.advance(max((t for t, _, _ in self._events), default=self.clock.now))
        assert all(r.active_requests == 0 and r.active_tokens == 0 and not r.active_by_prefix
                   for r in self.router.replicas), "the router's load did not return to zero"

    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.replicas.values())
        return sum(r.hit_tokens for r in self.replicas.values()) / prompt

    def served(self) -> Counter:
        return Counter({url: r.served for url, r in self.replicas.items()})


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(5, 32000) for _ in range(count)]


def multi_turn(sim: Simulation, *, seed: int = 0, conversations: int = 48, turns: int = 6,
               system_prompt: list[int] | None = None, interval: float = 0.01) -> None:
    """Conversations, each with its own opening context; each turn adds a user message and the reply. The
    turns of all conversations interleave in a seeded random order."""
    rng = random.Random(seed)
    histories = [(system_prompt or []) + tokens(rng, 128) for _ in range(conversations)]
    for _turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for conversation in order:
            histories[conversation] += tokens(rng, rng.randrange(16, 48))  # the user's message
            sim.advance(sim.clock.now + interval)
            sim.submit(histories[conversation])
            histories[conversation] += tokens(rng, rng.randrange(24, 64))  # the reply, part of the next turn
    sim.drain()


# --------------------------------------------------------------------------------------------------
# Hit rate
# --------------------------------------------------------------------------------------------------


def test_cache_aware_hits_at_least_three_times_round_robin_on_eight_replicas():
    rates = {}
    for policy in POLICIES:
        sim = Simulation(policy)
        multi_turn(sim)
        rates[policy] = sim.hit_rate()
        assert max(sim.served().values()) <= 1.5 * sum(sim.served().values()) / 8, (policy, sim.served())
    assert rates["cache_aware"] >= 3 * rates["round_robin"], rates
    assert rates["cache_aware"] > max(rates["power_of_two"], rates["random"]), rates
    assert rates["cache_aware"] > 0.6, rates


def test_the_same_seed_routes_the_same_way():
    runs = []
    for _ in range(2):
        sim = Simulation("power_of_two")
        multi_turn(sim, conversations=8, turns=2)
        runs.append(sim.served())
    assert runs[0] == runs[1]


# --------------------------------------------------------------------------------------------------
# Failure modes
# --------------------------------------------------------------------------------------------------


def test_a_shared_system_prompt_does_not_pile_onto_one_replica():
    """Every request starts with the same long system prompt. Weighted heavily toward hits, the cost alone
    would send them all to the replica that cached it first; the hot-prefix bound spreads them."""
    rng = random.Random(3)
    system_prompt = tokens(rng, 512)

    def burst(hot_prefix_share: float) -> Simulation:
        sim = Simulation("cache_aware", hit_weight=100.0, hot_prefix_share=hot_prefix_share)
        for _ in range(64):  # one burst: 64 questions in flight together
            sim.submit(system_prompt + tokens(rng, 24), output_tokens=256)
        sim.drain()
        return sim

    unbounded = burst(hot_prefix_share=1.0)
    assert max(unbounded.served().values()) > 0.9 * 64, "without the bound they pile up (the failure mode)"
    bounded = burst(hot_prefix_share=0.5)
    assert max(bounded.served().values()) <= 32 + 1, bounded.served()
    assert bounded.hit_rate() > 0.8, "the system prompt is still served from cache where it went"


def test_a_cache_miss_storm_spreads_like_load_balancing():
    """Only unique prompts: nothing to hit, so cache_aware must balance by load like the others."""
    sim = Simulation("cache_aware")
    rng = random.Random(4)
    for _ in range(400):
        sim.advance(sim.clock.now + 0.005)
        sim.submit(tokens(rng, rng.randrange(64, 512)))
    sim.drain()
    served = sim.served()
    assert sim.hit_rate() == 0
    assert max(served.values()) <= 1.5 * 400 / 8 and min(served.values()) >= 0.5 * 400 / 8, served


@pytest.mark.parametrize("how", ["restart", "silent_cache_reset"])
def test_a_replica_that_loses_its_cache_drops_out_of_the_index(how):
    sim = Simulation("cache_aware")
    rng = random.Random(5)
    histories = [tokens(rng, 256) for _ in range(16)]
    for history in histories:
        sim.submit(history)
    sim.drain()
    victim = next(r for r in sim.router.replicas if len(r.index) > 0)
    assert sim.mispredicted == 0
    sim.replicas[victim.url].reset_cache()
    if how == "restart":  # its counters start again from zero: the poller sees it
        sim.router.update_stats(victim, PolledStats(prefix_cache_queries=-1.0))
        assert len(victim.index) == 0
    served_before = sim.replicas[victim.url].served
    for _round in range(3):  # each conversation comes back three times
        for history in histories:
            history += tokens(rng, 32)
            sim.advance(sim.clock.now + 0.01)
            sim.submit(history)
        sim.drain()
    assert sim.replicas[victim.url].served > served_before and len(victim.index) > 0, "used again, learnt again"
    # A silent reset is found by the first response that reports fewer cached tokens than expected; that one
    # request is mispredicted, then the index no longer claims what the replica lost.
    assert sim.mispredicted <= (0 if how == "restart" else 1)
    assert sim.router.metrics.index_resets.labels(victim.url)._value.get() == 1


def test_a_replica_that_answers_only_429_is_skipped_until_its_retry_after():
    sim = Simulation("cache_aware", num_replicas=4)
    refusing = sim.replicas["http://replica-0"]
    refusing.answers_429 = True
    multi_turn(sim, conversations=16, turns=4, interval=0.05)  # 64 requests over ~3.2 s
    assert refusing.served == 0
    assert sum(sim.served().values()) == 64, "every request was served by another replica"
    assert refusing.refused <= 3.2 / 1.0 + 2, "tried again only once its Retry-After (1 s) had passed"


def test_when_every_replica_is_saturated_the_router_says_429_with_retry_after():
    sim = Simulation("round_robin", num_replicas=2)
    for replica in sim.router.replicas:
        sim.router.record_saturated(replica, 3.0)
    with pytest.raises(NoReplicaAvailable) as refused:
        sim.router.choose(RoutedPrompt([1, 2, 3]))
    assert refused.value.status == 429 and refused.value.retry_after_s == pytest.approx(3.0)
    sim.advance(3.0)
    assert sim.router.choose(RoutedPrompt([1, 2, 3])).replica is not None


def test_replicas_over_their_polled_queue_or_kv_threshold_are_skipped():
    sim = Simulation("cache_aware", num_replicas=3, max_waiting_requests=8, max_kv_usage=0.9)
    first, second, third = sim.router.replicas
    sim.router.update_stats(first, PolledStats(num_waiting=8))
    sim.router.update_stats(second, PolledStats(kv_usage=0.95))
    for _ in range(5):
        assert sim.router.choose(RoutedPrompt([1] * 40)).replica is third


def test_the_circuit_breaker_counts_only_failures():
    sim = Simulation("round_robin", num_replicas=2, breaker_failures=3, breaker_cooldown_s=5.0)
    flaky, healthy = sim.router.replicas
    for _ in range(10):
        sim.router.record_saturated(flaky, 0.0)  # 429s are load, not failures
        sim.router.record_success(flaky)  # as is any other answered status (a 4xx is the client's fault)
    assert flaky.routable(sim.clock.now)
    for _ in range(3):
        sim.router.record_failure(flaky)
    assert not flaky.routable(sim.clock.now)
    assert sim.router.metrics.ejections.labels(flaky.url)._value.get() == 1
    assert all(sim.router.choose(RoutedPrompt(None)).replica is healthy for _ in range(4))
    sim.advance(5.0)
    assert flaky.routable(sim.clock.now), "back after the cooldown"
    sim.router.record_failure(flaky)
    assert not flaky.routable(sim.clock.now), "one more failure after the cooldown ejects it again"
    for replica in (flaky, healthy):
        sim.router.set_health(replica, False)
    with pytest.raises(NoReplicaAvailable) as refused:
        sim.router.choose(RoutedPrompt(None))
    assert refused.value.status == 503


def test_leases_return_the_load_on_every_path():
    sim = Simulation("cache_aware", num_replicas=2)
    prompt = RoutedPrompt(list(range(100)))
    lease = sim.router.begin(sim.router.choose(prompt))
    replica = lease.decision.replica
    lease.add_output_tokens(5)
    assert replica.active_requests == 1 and replica.active_tokens == 105
    lease.finish(succeeded=False)
    lease.finish()  # idempotent: a cleanup that runs twice counts once
    assert replica.active_requests == 0 and replica.active_tokens == 0 and not replica.active_by_prefix
    assert replica.index.match(prompt.cacheable(BLOCK_SIZE), sim.clock.now) == 0, "a failed request's blocks"


# --------------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------------


def test_the_index_forgets_on_its_ttl_and_its_capacity():
    index = BlockIndex(ttl_s=10.0, max_blocks=3)
    index.insert([1, 2], now=0.0)
    index.insert([3], now=5.0)
    assert index.match([1, 2, 3], now=9.0) == 3
    assert index.match([1, 2], now=10.0) == 0, "expired"
    assert index.match([3], now=10.0) == 1
    index.insert([4, 5, 6], now=11.0)
    assert len(index) == 3 and index.match([3], now=11.0) == 0, "evicted, least recently routed first"
    index.forget([5])
    assert index.match([4, 5, 6], now=11.0) == 1
