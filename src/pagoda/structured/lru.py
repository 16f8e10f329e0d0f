"""A bounded, thread-safe LRU map: grammars are compiled from server threads and used by the engine thread."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """Holds at most `capacity` entries, and with `weight` at most `max_weight` of their summed weights (an
    entry heavier than that on its own is handed back, not stored); a lookup refreshes an entry, an insertion
    evicts the stalest."""

    def __init__(self, capacity: int, max_weight: int | None = None, weight: Callable[[K], int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if (max_weight is None) != (weight is None):
            raise ValueError("max_weight and weight go together")
        self.capacity, self.max_weight, self._weight = capacity, max_weight, weight
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._total_weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put_if_absent(self, key: K, value: V) -> V:
        """Store `value` unless `key` is already there, and return what is stored.

        Two threads that compiled the same key at once both end up with the first one's value.
        """
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            weight = self._weight(key) if self._weight is not None else 0
            if self.max_weight is not None and weight > self.max_weight:
                return value
            self._entries[key], self._total_weight = value, self._total_weight + weight
            while len(self._entries) > self.capacity or (
                    self.max_weight is not None and self._total_weight > self.max_weight):
                evicted, _ = self._entries.popitem(last=False)
                self._total_weight -= self._weight(evicted) if self._weight is not None else 0
            return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
