"""What the router believes one replica's prefix cache holds: block keys (`wire_block_hash`), LRU, with a TTL.

Approximate by construction: it learns from the router's own decisions (a routed prompt's full blocks will be
cached there), forgets on a TTL and a capacity bound as the replica's own LRU would, and is corrected by what
the replica reports (cached_tokens in a response's usage, a restart seen in its counters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockIndex:
    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        # NOTE invariant: every entry has the same TTL, so LRU order is expiry order: expired entries are
        # always a run at the front.
        self._expiry: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, key: int) -> bool:
        return key in self._expiry

    def match(self, block_keys: Sequence[int], now: float) -> int:
        """How many leading blocks of the chain are (believed) cached. Matching does not touch: only a routing
        decision does, as only a request that runs there makes the replica keep the blocks."""
        self._expire(now)
        matched = 0
        for key in block_keys:
            if key not in self._expiry:
                break
            matched += 1
        return matched

    def insert(self, block_keys: Sequence[int], now: float) -> None:
        """The blocks of a prompt routed here: cached, most recently used."""
        expiry = now + self.ttl_s
        for key in block_keys:
            self._expiry[key] = expiry
            self._expiry.move_to_end(key)
        while len(self._expiry) > self.max_blocks:
            self._expiry.popitem(last=False)

    def forget(self, block_keys: Sequence[int]) -> None:
        for key in block_keys:
            self._expiry.pop(key, None)

    def clear(self) -> None:
        self._expiry.clear()

    def expire(self, now: float) -> None:
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return
            del self._expiry[key]


def match_any(indexes: Sequence[BlockIndex], block_keys: Sequence[int], now: float) -> int:
    """How many leading blocks of the chain are (believed) held by any of the indexes: a replica serves a block
    from its KV pool, its local offload tier or a store every replica shares alike."""
    for index in indexes:
        index.expire(now)
    indexes = [index for index in indexes if index]  # most replicas have no offload tier: one index to ask
    if not indexes:
        return 0
    matched = 0
    for key in block_keys:
        if not any(key in index for index in indexes):
            break
        matched += 1
    return matched
