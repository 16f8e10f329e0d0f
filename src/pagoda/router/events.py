"""The router's side of KV events (vLLM's format, see pagoda.wire.kv_events): one ZMQ SUB socket per replica
that publishes them. What they say is what the replica's index holds: blocks stored, blocks removed, all
cleared. Such a replica's index is exact, so the router neither guesses from its own decisions nor expires.

A sequence number that goes back means the publisher restarted (the replica did): its index is dropped first.
A gap (messages lost) is counted; the index keeps what it had.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from pagoda.kv_transfer_config import DEVICE_MEDIUM, LOCAL_MEDIUM
from pagoda.router.core import Router
from pagoda.router.index import BlockIndex
from pagoda.router.replica import Replica
from pagoda.wire.kv_events import decode_batch, read_event

logger = logging.getLogger("pagoda.route")


def apply_events(router: Router, replica: Replica, events: Sequence[Any]) -> None:
    """One batch's events, in order, each into the index of its medium: the replica's KV pool ("GPU", or none
    given), its offload tier ("CPU"), or the store every replica shares. Unknown kinds and media are skipped (later
    releases add some); any of vLLM's encodings is read (pagoda.wire.kv_events.read_event)."""
    now = router.clock()
    for raw in events:
        event = read_event(raw)
        if event.kind == "AllBlocksCleared":  # the replica's KV pool was reset; its tiers keep their blocks
            replica.index.clear()
            router.metrics.index_resets.labels(replica.url).inc()
            continue
        index = _index_of(router, replica, event.medium)
        if index is None:
            continue
        if event.kind == "BlockStored":
            index.insert(event.block_hashes, now)
        elif event.kind == "BlockRemoved":
            index.forget(event.block_hashes)


def _index_of(router: Router, replica: Replica, medium: str | None) -> BlockIndex | None:
    if medium is None or medium == DEVICE_MEDIUM:
        return replica.index
    if medium == LOCAL_MEDIUM:
        return replica.offload_index
    if medium == router.config.shared_kv_medium:
        return router.shared_index
    return None


class EventStream:
    """One replica's stream: sequence checks, then the batch's events into its index."""

    def __init__(self, router: Router, replica: Replica) -> None:
        self.router = router
        self.replica = replica
        self.last_sequence: int | None = None

    def receive(self, sequence: int, payload: bytes) -> None:
        if self.last_sequence is not None and sequence <= self.last_sequence:
            logger.warning("kv events of %s started again at %d: the replica restarted", self.replica.url, sequence)
            self.router.reset_index(self.replica)
        elif self.last_sequence is not None and sequence > self.last_sequence + 1:
            self.router.metrics.event_gaps.labels(self.replica.url).inc(sequence - self.last_sequence - 1)
        self.last_sequence = sequence
        try:
            _ts, events = decode_batch(payload)
        except Exception as error:  # a malformed batch must not end the stream
            logger.warning("kv events of %s: undecodable batch %d skipped (%s)", self.replica.url, sequence, error)
            return
        apply_events(self.router, self.replica, events)


async def subscribe_forever(router: Router, replica: Replica, endpoint: str, topic: str = "") -> None:
    socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
    while True:  # a replica that does not exist yet (scaled to zero, DNS not there) is waited for
        try:
            socket.connect(endpoint)
            break
        except zmq.ZMQError as error:
            logger.debug("kv events of %s: cannot connect to %s yet (%s)", replica.url, endpoint, error)
            await asyncio.sleep(router.config.poll_interval_s)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    stream = EventStream(router, replica)
    try:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                logger.warning("kv events of %s: a message of %d frames skipped", replica.url, len(frames))
                continue
            _topic, sequence, payload = frames
            stream.receive(int.from_bytes(sequence, "big"), payload)
    finally:
        socket.close(linger=0)
