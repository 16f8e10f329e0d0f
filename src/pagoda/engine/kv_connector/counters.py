"""Per-tier counters, written by the engine thread (loads) and the save thread (saves): under a lock."""

from __future__ import annotations

import threading

from pagoda.engine.api import KVTierStats


class TierCounters:
    def __init__(self, medium: str) -> None:
        self.medium = medium
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] = self._values.get(name, 0) + amount

    def snapshot(self) -> KVTierStats:
        with self._lock:
            values = dict(self._values)
        ints = {name: int(values.get(name, 0)) for name in (
            "hit_blocks", "hit_tokens", "bytes_loaded", "bytes_saved", "blocks_saved", "failures", "refused_blocks",
            "evicted_blocks")}
        return KVTierStats(self.medium, **ints, load_seconds=values.get("load_seconds", 0.0),
                           save_seconds=values.get("save_seconds", 0.0))
