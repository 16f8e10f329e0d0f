"""A bounded, thread-safe LRU map: grammars are compiled from server threads and used by the engine thread."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """Holds at most `capacity` entries; a lookup refreshes an entry, an insertion evicts the stalest."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
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
            stored = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return stored

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
