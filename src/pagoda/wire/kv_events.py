"""KV events in vLLM's wire format: what a replica's prefix cache stores and removes, published over ZMQ so
that routers (pagoda's, and those built for vLLM) see what each replica really holds.

The format is vLLM v0.9.0's, the release that introduced KV events (`vllm/distributed/kv_events.py` there):

- `--kv-events-config` takes vLLM's KVEventsConfig as JSON: enable_kv_cache_events, publisher ("null" or
  "zmq"), endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic (defaults below, as vLLM's).
- Each message is three ZMQ frames: topic (utf-8), sequence number (8 bytes, big-endian, from 0), payload.
- The payload is a msgpack-encoded KVEventBatch, a msgspec array-like struct: [ts, events], ts a float
  (seconds since the epoch). Each event is a tagged array-like struct, the tag (its class name) first:
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]
    ["BlockRemoved", block_hashes]
    ["AllBlocksCleared"]
  block hashes are unsigned 64-bit integers (pagoda.block_hash.wire_block_hash), parent_block_hash is nil
  for a first block, lora_id is nil.
- With a replay_endpoint, a ROUTER socket answers a request frame holding a start sequence number (8 bytes,
  big-endian) with every buffered [seq, payload] from there, then [-1 as 8 signed bytes, b""].

Both sides read this module: the replicas' publisher (server/kv_events.py) and the router's subscriber
(router/events.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]  # (no stubs, no py.typed)

from pagoda.block_hash import wire_block_hash

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: its field names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {', '.join(PUBLISHERS)}, not {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"kv events {name} must be a positive integer")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kv events config field(s): {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**values)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# --- the wire format ---------------------------------------------------------------------------------


def block_stored(block_hashes: Sequence[bytes], parent_hash: bytes | None, token_ids: Sequence[int],
                 block_size: int) -> list[Any]:
    parent = wire_block_hash(parent_hash) if parent_hash is not None else None
    return ["BlockStored", [wire_block_hash(h) for h in block_hashes], parent, list(token_ids), block_size, None]


def block_removed(block_hashes: Sequence[bytes]) -> list[Any]:
    return ["BlockRemoved", [wire_block_hash(h) for h in block_hashes]]


def all_blocks_cleared() -> list[Any]:
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[list[Any]]) -> bytes:
    packed: bytes = msgpack.packb([ts, list(events)], use_bin_type=True)
    return packed


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """The inverse of encode_batch, for consumers (the router)."""
    ts, events = msgpack.unpackb(payload, raw=False)
    return float(ts), [list(event) for event in events]
