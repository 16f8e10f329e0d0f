"""The replicas' side of KV events: a publisher the engine's KV manager reports to, sending vLLM's batches
(the format: pagoda.wire.kv_events) over ZMQ.

The KV manager (on the engine thread) and the offload tiers (on their save thread) call the publisher (a
KVEventSink); it only queues, under a lock. A thread of its own
batches what was queued every FLUSH_INTERVAL_S and sends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from pagoda.kv_transfer_config import DEVICE_MEDIUM
from pagoda.wire.kv_events import (
    END_OF_REPLAY,
    KVEventsConfig,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
)

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.01


class ZmqKVEventPublisher:
    """A KVEventSink that publishes batches on a ZMQ PUB socket (and serves replays on a ROUTER socket)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._pending: list[dict[str, Any]] = []
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
                      block_size: int, medium: str = DEVICE_MEDIUM) -> None:
        self._queue(block_stored(block_hashes, parent_hash, token_ids, block_size, medium))

    def blocks_removed(self, block_hashes: Sequence[bytes], medium: str = DEVICE_MEDIUM) -> None:
        self._queue(block_removed(block_hashes, medium))

    def all_blocks_cleared(self) -> None:
        self._queue(all_blocks_cleared())

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _queue(self, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self._pending) >= self.config.max_queue_size:
                self._dropped += 1  # never block the engine thread; logged by the publishing thread
                return
            self._pending.append(event)

    # --- the publishing thread (owns the sockets: ZMQ sockets are not thread-safe) ------------------------

    def _run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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
    def _serve_replay(replay: zmq.Socket[bytes], buffer: deque[tuple[int, bytes]]) -> None:
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
