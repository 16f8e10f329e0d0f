"""KV events in vLLM's wire format: what a replica's KV pool and its offload tiers store and remove, published over
ZMQ so that routers (pagoda's, and those built for vLLM) see what each replica really holds.

The format is current vLLM's (`vllm/distributed/kv_events.py`: msgspec structs, map-encoded, tagged):

- `--kv-events-config` takes vLLM's KVEventsConfig as JSON: enable_kv_cache_events, publisher ("null" or
  "zmq"), endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic (defaults below, as vLLM's).
- Each message is three ZMQ frames: topic (utf-8), sequence number (8 bytes, big-endian, from 0), payload.
- The payload is a msgpack-encoded KVEventBatch: a map {"ts": float (seconds since the epoch), "events": [...]}
  (vLLM's optional data_parallel_rank is left out, as its default is). Each event is a map whose "type" is its
  class name, then its fields in vLLM's order (fields with a default are left out at their default):
    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
     "lora_name"}
    {"type": "BlockRemoved", "block_hashes", "medium"}
    {"type": "AllBlocksCleared"}
  block hashes are unsigned 64-bit integers (pagoda.block_hash.wire_block_hash), parent_block_hash is nil for a
  first block, lora_id and lora_name are nil. `medium` says where the blocks are: "GPU" the replica's own KV pool
  (vLLM's name, whatever the device), "CPU" its local offload tier, "SHARED" (or the configured shared medium) a
  store every replica reads (docs/kv-offload.md).
- With a replay_endpoint, a ROUTER socket answers a request frame holding a start sequence number (8 bytes,
  big-endian) with every buffered [seq, payload] from there, then [-1 as 8 signed bytes, b""].

Readers (`read_event`) also take the array-like encodings of earlier vLLM releases (v0.9.0's positional
[tag, block_hashes, parent, token_ids, block_size, lora_id] and later ones with medium appended), so a router
reads replicas of any of them. Both sides read this module: the replicas' publisher (server/kv_events.py) and
the router's subscriber (router/events.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]  # (no stubs, no py.typed)

from pagoda.block_hash import wire_block_hash
from pagoda.kv_transfer_config import DEVICE_MEDIUM

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
                 block_size: int, medium: str = DEVICE_MEDIUM) -> dict[str, Any]:
    parent = wire_block_hash(parent_hash) if parent_hash is not None else None
    return {"type": "BlockStored", "block_hashes": [wire_block_hash(h) for h in block_hashes],
            "parent_block_hash": parent, "token_ids": list(token_ids), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None}


def block_removed(block_hashes: Sequence[bytes], medium: str = DEVICE_MEDIUM) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [wire_block_hash(h) for h in block_hashes], "medium": medium}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Mapping[str, Any]]) -> bytes:
    packed: bytes = msgpack.packb({"ts": ts, "events": list(events)}, use_bin_type=True)
    return packed


def decode_batch(payload: bytes) -> tuple[float, list[Any]]:
    """The inverse of encode_batch, for consumers (the router); an array-like batch ([ts, events, ...]) too."""
    batch = msgpack.unpackb(payload, raw=False)
    if isinstance(batch, dict):
        return float(batch["ts"]), list(batch["events"])
    return float(batch[0]), list(batch[1])


@dataclass(frozen=True)
class KVEvent:
    """One event as a reader needs it: its kind, the blocks it is about (wire hashes) and their medium."""

    kind: str | None
    block_hashes: list[int]
    medium: str | None


def read_event(event: Any) -> KVEvent:
    """An event in any of vLLM's encodings: a tagged map (current), or a positional array (v0.9.0's, and later
    array-like releases with medium after lora_id). Unknown kinds keep their name and no blocks."""
    if isinstance(event, dict):
        kind = event.get("type")
        return KVEvent(kind if isinstance(kind, str) else None, list(event.get("block_hashes") or []),
                       event.get("medium"))
    if not isinstance(event, (list, tuple)) or not event or not isinstance(event[0], str):
        return KVEvent(None, [], None)
    kind = event[0]
    hashes = list(event[1]) if len(event) > 1 and isinstance(event[1], list) else []
    medium_at = {"BlockStored": 6, "BlockRemoved": 2}.get(kind)
    medium = event[medium_at] if medium_at is not None and len(event) > medium_at else None
    return KVEvent(kind, hashes, medium if isinstance(medium, str) else None)
