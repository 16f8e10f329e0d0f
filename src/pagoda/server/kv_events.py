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

The engine's KV manager calls the publisher (a KVEventSink) on the engine thread; it only queues. A thread of
its own batches what was queued every FLUSH_INTERVAL_S and sends it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from pagoda.block_hash import wire_block_hash

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.01
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
    return msgpack.packb([ts, list(events)], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]]]:
    """The inverse of encode_batch, for consumers (the router)."""
    ts, events = msgpack.unpackb(payload, raw=False)
    return float(ts), [list(event) for event in events]


# --- the publisher ---------------------------------------------------------------------------------------


class ZmqKVEventPublisher:
    """A KVEventSink that publishes batches on a ZMQ PUB socket (and serves replays on a ROUTER socket)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._pending: list[list[Any]] = []
        self._lock = threading.Lock()
        self._dropped = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagoda-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # e.g. the endpoint's port is taken: fail at start, naming it
            raise ValueError(f"kv events endpoint {config.endpoint}: {self._error}") from self._error

    # KVEventSink: called on the engine thread
    def blocks_stored(self, block_hashes: Sequence[bytes], parent_hash: bytes | None, token_ids: Sequence[int],
                      block_size: int) -> None:
        self._queue(block_stored(block_hashes, parent_hash, token_ids, block_size))

    def blocks_removed(self, block_hashes: Sequence[bytes]) -> None:
        self._queue(block_removed(block_hashes))

    def all_blocks_cleared(self) -> None:
        self._queue(all_blocks_cleared())

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _queue(self, event: list[Any]) -> None:
        with self._lock:
            if len(self._pending) >= self.config.max_queue_size:
                self._dropped += 1  # never block the engine thread; logged by the publishing thread
                return
            self._pending.append(event)

    # --- the publishing thread (owns the sockets: ZMQ sockets are not thread-safe) ------------------------

    def _run(self) -> None:
        context = zmq.Context.instance()
        try:
            publisher = context.socket(zmq.PUB)
            publisher.set_hwm(self.config.hwm)
            endpoint = self.config.endpoint
            # vLLM's convention: bind a wildcard or local endpoint, connect to a remote one.
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                publisher.bind(endpoint)
            else:
                publisher.connect(endpoint)
            replay = None
            if self.config.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as error:
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        topic, sequence = self.config.topic.encode(), 0
        try:
            while not self._stop.is_set() or self._pending:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, buffer)
                with self._lock:
                    events, self._pending = self._pending, []
                    dropped, self._dropped = self._dropped, 0
                if dropped:
                    logger.warning("kv events: %d events dropped (max_queue_size %d)", dropped,
                                   self.config.max_queue_size)
                if events:
                    payload = encode_batch(time.time(), events)
                    publisher.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
                    buffer.append((sequence, payload))
                    sequence += 1
                self._stop.wait(FLUSH_INTERVAL_S)
        finally:
            publisher.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    @staticmethod
    def _serve_replay(replay: zmq.Socket, buffer: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(buffer):
            if sequence >= first:
                replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqKVEventPublisher | None:
    return ZmqKVEventPublisher(config) if config is not None and config.publishes else None
