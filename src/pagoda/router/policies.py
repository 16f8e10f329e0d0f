"""Routing policies: one interface, chosen at construction (`make_policy`).

Each picks one replica among the candidates the router hands it (up, not ejected, not saturated); none of
them sees a replica that cannot take the request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.block_hash import hash_block_chain, max_cacheable_blocks, wire_block_hash
from pagoda.router.config import RouterConfig
from pagoda.router.replica import Replica


@dataclass
class RoutedPrompt:
    """A request's prompt as routing sees it: token ids (None when the router could not tokenize it: then
    only load decides), the cache salt that keys its first block, and the model it names (an adapter's name
    routes it to the replicas that serve that adapter)."""

    token_ids: Sequence[int] | None
    cache_salt: str | None = None
    model: str | None = None
    _chains: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _cacheable: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0

    def block_hashes(self, block_size: int) -> list[int]:
        """Every full block's hash (as KV events carry it: `wire_block_hash`): what the replica's prefix cache
        will hold once it has run the prompt."""
        if self.token_ids is None:
            return []
        if block_size not in self._chains:
            chain = hash_block_chain(self.token_ids, block_size, self.cache_salt)
            self._chains[block_size] = [wire_block_hash(block_hash) for block_hash in chain]
        return self._chains[block_size]

    def cacheable(self, block_size: int) -> list[int]:
        """The blocks a prefix-cache hit can serve (never the one holding the last prompt token). Kept: a policy
        asks once per replica."""
        if block_size not in self._cacheable:
            self._cacheable[block_size] = self.block_hashes(block_size)[
                : max_cacheable_blocks(self.num_tokens, block_size)]
        return self._cacheable[block_size]

    def prefix_key(self, block_size: int) -> int | None:
        """The first block: requests sharing it share a (system) prompt."""
        hashes = self.block_hashes(block_size)
        return hashes[0] if hashes else None


class RoutingPolicy(Protocol):
    name: str

    def choose(self, prompt: RoutedPrompt, candidates: Sequence[Replica], now: float) -> Replica:
        """One of `candidates` (never empty)."""
        ...


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, prompt: RoutedPrompt, candidates: Sequence[Replica], now: float) -> Replica:
        replica = candidates[self._turn % len(candidates)]
        self._turn += 1
        return replica


class RandomPolicy:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, prompt: RoutedPrompt, candidates: Sequence[Replica], now: float) -> Replica:
        return self._rng.choice(list(candidates))


class PowerOfTwoPolicy:
    """Two replicas drawn at random, the less loaded one taken: near-best balance without global state."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, prompt: RoutedPrompt, candidates: Sequence[Replica], now: float) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        drawn = self._rng.sample(list(candidates), 2)
        return min(drawn, key=lambda replica: (replica.load_tokens(), replica.active_requests))


class CacheAwarePolicy:
    """The cheapest replica: hit_weight x the prompt tokens it would have to compute (its index's longest match
    counts as cached) + its load in tokens. A replica past its bounded share of the prompt's hot prefix is
    passed over while another can take it. Ties (an idle fleet and a new prompt) go to the replica with the
    fewest requests in flight, then to the one the router has used least, so that new conversations spread
    evenly however short their requests are."""

    name = "cache_aware"

    def __init__(self, config: RouterConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng

    def choose(self, prompt: RoutedPrompt, candidates: Sequence[Replica], now: float) -> Replica:
        bounds = {size: self._hot_prefix_bound(prompt, size, candidates) for size in {r.block_size for r in candidates}}
        within_share = [r for r in candidates if not _over(bounds[r.block_size], r)]
        scored = [(self.cost(prompt, r, now), r.active_requests, r.routed_requests, self._rng.random(), index)
                  for index, r in enumerate(within_share or candidates)]
        return (within_share or list(candidates))[min(scored)[4]]

    def cost(self, prompt: RoutedPrompt, replica: Replica, now: float) -> float:
        matched = replica.match(prompt.cacheable(replica.block_size), now)
        uncached = prompt.num_tokens - matched * replica.block_size
        return self.config.hit_weight * uncached + replica.load_tokens()

    def _hot_prefix_bound(self, prompt: RoutedPrompt, block_size: int,
                          candidates: Sequence[Replica]) -> tuple[int, int] | None:
        """(the prompt's prefix key at this block size, the most of its requests in flight one replica may hold
        with this one), or None while the prefix is not hot. Counted once per choice, not once per replica: a
        fleet of N replicas costs N, not N²."""
        key = prompt.prefix_key(block_size)
        if key is None:
            return None
        in_flight = sum(r.active_by_prefix.get(key, 0) for r in candidates) + 1  # with this request
        if in_flight < self.config.hot_prefix_min_inflight:
            return None
        return key, max(1, math.ceil(self.config.hot_prefix_share * in_flight))


def _over(bound: tuple[int, int] | None, replica: Replica) -> bool:
    """Is the replica past its share of the hot prefix's requests (this one included)?"""
    return bound is not None and replica.active_by_prefix.get(bound[0], 0) + 1 > bound[1]


def make_policy(config: RouterConfig) -> RoutingPolicy:
    rng = random.Random(config.seed)
    policies: dict[str, RoutingPolicy] = {
        "cache_aware": CacheAwarePolicy(config, rng), "round_robin": RoundRobinPolicy(),
        "power_of_two": PowerOfTwoPolicy(rng), "random": RandomPolicy(rng),
    }
    return policies[config.policy]
