"""The stores behind the offload tiers, one small interface: `contains` (how many of the leading keys it
holds), `get`, `put`. A store that is down or slow never fails a request: each call is bounded in time and, on
failure, answers "nothing here" (the tokens are computed instead) and counts the failure. Torch-free.

The local tier (`LocalStore`) is a bounded LRU of fixed-size slots in one anonymous memory mapping sized by
`--kv-offloading-size`. Why a private mapping and not a named shared-memory segment or a file: every value of an
engine has one size (its block layout), so fixed slots never fragment and evicting is O(1); pages become resident
only once written (an idle tier costs nothing); the OS reclaims it whatever way the process ends (a named segment
outlives a killed process); and sharing across processes and hosts is the shared tier's job (redis_store.py).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from pagoda.engine.kv_connector.counters import TierCounters


class KVStore(Protocol):
    medium: str  # what its KV events and metrics call it ("CPU", the shared medium's name)
    counters: TierCounters
    # Held across a put and the BlockStored event for it, so that a removal the store reports for the key is
    # published after the event of the store that it undoes.
    event_order: AbstractContextManager[object]

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, it holds (0 when it cannot tell within its wait)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value, None where it has none (all None when it cannot answer within its wait)."""
        ...

    def put(self, key: bytes, value: bytes) -> bool:
        """Stores a value; False when it could not (the block is then simply not offloaded there)."""
        ...

    def close(self) -> None: ...


class LocalStore:
    """A bounded LRU of `slot_bytes` slots in host memory. `on_evict` hears the keys its puts evict."""

    def __init__(self, capacity_bytes: int, slot_bytes: int, medium: str,
                 on_evict: Callable[[list[bytes]], None] | None = None) -> None:
        self.num_slots = capacity_bytes // slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"the local KV tier of {capacity_bytes} bytes holds no block of {slot_bytes} bytes")
        self.medium = medium
        self.counters = TierCounters(medium)
        self.event_order: AbstractContextManager[object] = contextlib.nullcontext()  # evictions: inside put
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(-1, self.num_slots * slot_bytes)
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (slot, length), LRU first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._on_evict = on_evict

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            count = 0
            for key in keys:
                if key not in self._entries:
                    break
                count += 1
            return count

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        values: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    values.append(None)
                    continue
                self._entries.move_to_end(key)
                slot, length = entry
                start = slot * self.slot_bytes
                values.append(self._map[start : start + length])
        return values

    def put(self, key: bytes, value: bytes) -> bool:
        if len(value) > self.slot_bytes:
            return False
        evicted: list[bytes] = []
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                slot = entry[0]
            elif self._free:
                slot = self._free.pop()
            else:
                old_key, (slot, _) = self._entries.popitem(last=False)
                evicted.append(old_key)
            start = slot * self.slot_bytes
            self._map[start : start + len(value)] = value
            self._entries[key] = (slot, len(value))
        if evicted:
            self.counters.add(evicted_blocks=len(evicted))
            if self._on_evict is not None:
                self._on_evict(evicted)
        return True

    def corrupt(self, key: bytes, offset: int) -> None:
        """Flips one byte of a stored value (for tests of what a corrupt block does)."""
        with self._lock:
            slot, length = self._entries[key]
            position = slot * self.slot_bytes + offset % length
            self._map[position] ^= 0xFF

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._map.close()
