"""The OffloadingConnector under a split model (tensor and pipeline parallelism): every rank saves and loads its
own share of each block (its KV heads of its stage's layers), under keys that hold its rank, so the bytes a rank
moves are its share of the block, never a gather on rank 0.

Rank 0 runs the scheduler side and its own worker side; each call of the worker side is also sent down the
workers' pipes (the same pipes as the steps, so a worker meets it in step order: a load before the forward that
needs it, a save after the forward that filled the blocks). Loads end in a collective: each request's count of
loaded blocks is the smallest any rank loaded (an all-reduce MIN over the world), so a block one rank could not
load, evicted from its tier or refused, is computed by every rank. The counters and KV events are rank 0's.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.engine.api import KVEventSink, KVTierStats
from pagoda.engine.kv_connector.base import KVConnector
from pagoda.engine.kv_connector.factory import build_offload_worker
from pagoda.engine.kv_connector.offload import BlockHashes, OffloadingScheduler
from pagoda.engine.kv_connector.offload_worker import OffloadingWorker

Broadcast = Callable[[bytes], None]  # sends one pickled message down every worker's pipe


@dataclass(frozen=True)
class KVConnectorCall:
    """A worker-side call, as rank 0 made it, for a worker rank to make on its own share."""

    method: str  # "start_load_kv", "save_kv" or "wait_for_saves"
    metadata: object = None
    skip: tuple[str, ...] = ()
    timeout_s: float = 10.0

    def apply(self, worker: OffloadingWorker) -> None:
        if self.method == "start_load_kv":
            worker.start_load_kv(self.metadata)
        elif self.method == "save_kv":
            worker.save_kv(self.metadata, self.skip)
        elif self.method == "wait_for_saves":
            worker.wait_for_saves(self.timeout_s)
            dist.barrier()
        else:
            raise ValueError(f"unknown KV connector call {self.method!r}")


def agree_across_ranks(counts: list[int]) -> list[int]:
    """Each load's blocks loaded on this rank -> the smallest count of any rank (a collective: every rank calls
    it for the same loads, in the same order)."""
    tensor = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return [int(count) for count in tensor.tolist()]


class SplitOffloadingWorker:
    """Rank 0's worker side: each call goes to the workers, then rank 0 makes it on its own share. Called from the
    thread that steps the engine (the pipes carry the steps too)."""

    def __init__(self, local: OffloadingWorker, broadcast: Broadcast) -> None:
        self.local = local
        self.broadcast = broadcast

    @property
    def tiers(self) -> Sequence[object]:
        return self.local.tiers

    def start_load_kv(self, metadata: object) -> dict[str, int]:
        if getattr(metadata, "loads", ()):  # no loads, no collective, on any rank
            self._send(KVConnectorCall("start_load_kv", metadata))
        return self.local.start_load_kv(metadata)

    def save_kv(self, metadata: object, skip: Collection[str] = ()) -> None:
        if getattr(metadata, "saves", ()):
            self._send(KVConnectorCall("save_kv", metadata, tuple(skip)))
        self.local.save_kv(metadata, skip)

    def wait_for_saves(self, timeout_s: float = 10.0) -> None:
        """Returns once every rank's saves handed over so far are done (or each rank's timeout passed)."""
        self._send(KVConnectorCall("wait_for_saves", timeout_s=timeout_s))
        self.local.wait_for_saves(timeout_s)
        dist.barrier()

    def tier_stats(self) -> list[KVTierStats]:
        return self.local.tier_stats()

    def shutdown(self) -> None:
        self.local.shutdown()  # each worker rank shuts its own down as it stops

    def _send(self, call: KVConnectorCall) -> None:
        self.broadcast(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))


def build_split_connector(config: EngineConfig, layers: Sequence[Sequence[torch.Tensor]], block_size: int,
                          block_hashes: BlockHashes, events: KVEventSink | None, broadcast: Broadcast) -> KVConnector:
    """Rank 0's connector: the scheduler side over rank 0's tiers (a lookup there says what every rank should
    hold; the loads' agreement settles what they do), and the worker side that reaches every rank."""
    transfer = config.kv_transfer_config
    assert transfer is not None and transfer.kv_connector == "OffloadingConnector"
    local, namespace = build_offload_worker(config, transfer, layers, block_size, 0, events, agree_across_ranks)
    scheduler = OffloadingScheduler(local.tiers, namespace, block_size, block_hashes, transfer.loads, transfer.saves)
    return KVConnector(scheduler, SplitOffloadingWorker(local, broadcast))


def build_rank_worker(config: EngineConfig, layers: Sequence[Sequence[torch.Tensor]], block_size: int,
                      rank: int) -> OffloadingWorker:
    """A worker rank's own worker side (no scheduler side, no events)."""
    transfer = config.kv_transfer_config
    assert transfer is not None
    worker, _ = build_offload_worker(config, transfer, layers, block_size, rank, None, agree_across_ranks)
    return worker
