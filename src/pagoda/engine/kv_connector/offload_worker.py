"""The OffloadingConnector's worker side: copies blocks between the KV pool's tensors and the tiers.

Loads run at the start of the step, before its forward (the runner calls `start_load_kv` and waits for it): each
tier is asked, in order, for the keys still missing, each call bounded by the store's wait; a block that no tier
has, or whose value is refused (corrupt, another layout), ends the request's load there, and the request is
reported with the tokens that did load. Saves run after the forward: the blocks' rows are copied out of the pool
into one host buffer at once (the next step may reuse the blocks), and a thread of its own encodes and puts them,
so a slow store never stalls a step; when that thread falls behind, new saves are dropped and counted.

A layer's KV is a sequence of slot-major tensors ([num_slots, ...] each, however many a layer has): a block is
rows [block_id * block_size, (block_id + 1) * block_size) of every one of them, copied as raw bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from pagoda.engine.api import KVEventSink, KVTierStats
from pagoda.engine.kv_connector.block_format import BlockLayout, BlockRefused, decode_block, encode_block, layout_of
from pagoda.engine.kv_connector.keys import NAMESPACE_BYTES, block_hash_of
from pagoda.engine.kv_connector.offload import BlockSave, OffloadMetadata, RequestLoad
from pagoda.engine.kv_connector.stores import KVStore, LocalStore

logger = logging.getLogger(__name__)

Agree = Callable[[list[int]], list[int]]  # each load's blocks loaded here -> the count every rank loaded

SAVE_QUEUE_BATCHES = 64  # steps' saves waiting for the save thread before new ones are dropped


def block_layout(layers: Sequence[Sequence[torch.Tensor]], block_size: int) -> BlockLayout:
    """What one block of these tensors is stored as: each tensor's rows for one block, in order."""
    specs = []
    for tensors in layers:
        for tensor in tensors:
            shape = (block_size, *tensor.shape[1:])
            specs.append((str(tensor.dtype).removeprefix("torch."), shape,
                          block_size * tensor[0].numel() * tensor.element_size()))
    return layout_of(specs)


class OffloadingWorker:
    def __init__(self, tiers: Sequence[KVStore], layers: Sequence[Sequence[torch.Tensor]], block_size: int,
                 events: KVEventSink | None = None, agree: Agree = list, namespace: bytes | None = None) -> None:
        """namespace: this rank's, under which it stores and loads the keys the scheduler side (rank 0) names."""
        self.tiers = list(tiers)
        self.agree = agree
        self.namespace = namespace
        self.tensors = [tensor for tensors in layers for tensor in tensors]
        self.block_size = block_size
        self.layout = block_layout(layers, block_size)
        self.events = events
        self._staging = torch.empty(self.layout.payload_bytes, dtype=torch.uint8)
        self._jobs: queue.Queue[tuple[list[BlockSave], torch.Tensor] | tuple[bytes, bytes] | None] = queue.Queue(
            SAVE_QUEUE_BATCHES)
        self._thread = threading.Thread(target=self._save_loop, name="pagoda-kv-offload", daemon=True)
        self._thread.start()

    # --- loads -----------------------------------------------------------------------------------------

    def start_load_kv(self, metadata: object) -> dict[str, int]:
        """Loads the step's blocks; returns, for each request whose load failed, the tokens whose KV is valid.
        Under tensor parallelism every rank loads its own share and `agree` makes each request's count the
        smallest any rank loaded: a block one rank could not load is computed by all."""
        assert isinstance(metadata, OffloadMetadata)
        if not metadata.loads:
            return {}
        loaded = [self._load(load) for load in metadata.loads]
        counts = self.agree([len(hits) for hits in loaded])
        failures = {}
        for load, hits, count in zip(metadata.loads, loaded, counts):
            for source, num_bytes in hits[:count]:
                self.tiers[source].counters.add(hit_blocks=1, hit_tokens=self.block_size, bytes_loaded=num_bytes)
            if count < len(load.blocks):
                failures[load.request_id] = load.first_token + count * self.block_size
        return failures

    def _load(self, load: RequestLoad) -> list[tuple[int, int]]:
        """Loads the request's blocks in order up to the first that cannot be; returns, for each that did, its
        tier's index and its stored bytes."""
        keys = [self.own_key(block.key) for block in load.blocks]
        values: list[bytes | None] = [None] * len(keys)
        sources: list[int] = [-1] * len(keys)
        for index, tier in enumerate(self.tiers):
            missing = [i for i, value in enumerate(values) if value is None]
            if not missing:
                break
            started = time.perf_counter()
            for i, value in zip(missing, tier.get([keys[i] for i in missing])):
                if value is not None:
                    values[i], sources[i] = value, index
            tier.counters.add(load_seconds=time.perf_counter() - started)
        hits: list[tuple[int, int]] = []
        for key, block, value, source in zip(keys, load.blocks, values, sources):
            if value is None:
                return hits
            tier = self.tiers[source]
            try:
                payload = decode_block(self.layout, value)
            except BlockRefused as refused:
                tier.counters.add(refused_blocks=1)
                logger.warning("KV block refused from %s (%s): computed instead", tier.medium, refused)
                return hits
            started = time.perf_counter()
            self._copy_in(block.block_id, payload)
            tier.counters.add(load_seconds=time.perf_counter() - started)
            hits.append((source, len(value)))
            if source > 0 and isinstance(self.tiers[0], LocalStore):
                self._enqueue((key, value))  # a shared hit goes down to the local tier too
        return hits

    def own_key(self, key: bytes) -> bytes:
        """The key of this rank's share of the block that `key` (rank 0's) names."""
        return key if self.namespace is None else self.namespace + key[NAMESPACE_BYTES:]

    def _copy_in(self, block_id: int, payload: memoryview) -> None:
        self._staging.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        start, offset = block_id * self.block_size, 0
        for tensor, spec in zip(self.tensors, self.layout.tensors):
            rows = tensor[start : start + self.block_size]
            rows.view(torch.uint8).view(-1).copy_(self._staging[offset : offset + spec.num_bytes])
            offset += spec.num_bytes

    # --- saves -----------------------------------------------------------------------------------------

    def save_kv(self, metadata: object, skip: Collection[str] = ()) -> None:
        """Copies the step's newly full blocks out of the pool and hands them to the save thread (`skip`: requests
        that did not run this step)."""
        assert isinstance(metadata, OffloadMetadata)
        saves = [save for save in metadata.saves if save.request_id not in skip]
        if not saves:
            return
        buffer = torch.empty((len(saves), self.layout.payload_bytes), dtype=torch.uint8)
        for row, save in zip(buffer, saves):
            start, offset = save.block_id * self.block_size, 0
            for tensor, spec in zip(self.tensors, self.layout.tensors):
                rows = tensor[start : start + self.block_size]
                row[offset : offset + spec.num_bytes].copy_(rows.view(torch.uint8).view(-1))
                offset += spec.num_bytes
        self._enqueue((saves, buffer))

    def _enqueue(self, job: tuple[list[BlockSave], torch.Tensor] | tuple[bytes, bytes]) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            for tier in self.tiers:
                tier.counters.add(failures=1)

    def _save_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if isinstance(job[0], bytes):
                    key, value = job
                    assert isinstance(key, bytes) and isinstance(value, bytes)
                    self._put(0, [key], [value], [None])
                else:
                    saves, buffer = job
                    assert isinstance(buffer, torch.Tensor) and isinstance(saves, list)
                    rows = buffer.numpy()
                    values = [encode_block(self.layout, memoryview(rows[i])) for i in range(len(saves))]
                    for index in range(len(self.tiers)):
                        self._put(index, [self.own_key(save.key) for save in saves], values, saves)
            except Exception:  # a save that fails is a block not offloaded, never an engine failure
                logger.exception("KV offload: a save failed")
            finally:
                self._jobs.task_done()

    def _put(self, index: int, keys: list[bytes], values: list[bytes], saves: Sequence[BlockSave | None]) -> None:
        tier = self.tiers[index]
        for key, value, save in zip(keys, values, saves):
            with tier.event_order:
                started = time.perf_counter()
                if not tier.put(key, value):
                    continue
                tier.counters.add(bytes_saved=len(value), blocks_saved=1, save_seconds=time.perf_counter() - started)
                if self.events is not None and save is not None:
                    self.events.blocks_stored([block_hash_of(save.key)], save.parent_hash, save.token_ids,
                                              self.block_size, medium=tier.medium)

    def tier_stats(self) -> list[KVTierStats]:
        return [tier.counters.snapshot() for tier in self.tiers]

    def wait_for_saves(self, timeout_s: float = 10.0) -> None:
        """Returns once every save handed over so far is done (tests and the benchmark use it)."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5.0)
        for tier in self.tiers:
            tier.close()
