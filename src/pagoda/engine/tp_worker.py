"""A worker process: ranks 1..N-1 of a model split across processes (rank 0 is the engine's), tensor-parallel
ranks of one pipeline stage or several; spawned by the engine here, or started by an external launcher
(engine/external_ranks.py), which joins the group its own way and then loads and serves as below.

It loads its share, then runs every ModelStep the engine sends down its pipe, with the other ranks (its
collectives meet theirs inside the forward, its stage's activations go point to point to the next stage's
ranks); rank 0 alone samples, so a worker's logits are dropped (the last stage's first rank sends them to rank 0).
It ends when the engine says so, or when its pipe closes: the engine has gone, however it ended.
"""

from __future__ import annotations

import pickle
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (not in torch's __all__)

from pagoda.config import EngineConfig
from pagoda.cpu_sets import BoundCpus
from pagoda.engine.kv_connector.offload_worker import OffloadingWorker
from pagoda.engine.kv_connector.split import KVConnectorCall, build_rank_worker
from pagoda.engine.lora_manager import AdapterSlots, AdapterSlotsCall
from pagoda.engine.model_step import (
    ModelExecution,
    ModelStep,
    RankReport,
    attach_engine_lora,
    kv_layer_tensors,
    load_engine_model,
    rank_report,
)
from pagoda.engine.rank_placement import place_rank
from pagoda.engine.rank_watchdog import start_heartbeat
from pagoda.kv_groups import KVCacheGroup
from pagoda.model.loader import TORCH_DTYPES

STOP = pickle.dumps(None)  # the engine's last message to a worker
STARTUP_TIMEOUT_S = 120.0  # for the ranks to start and meet; loading then takes what it takes


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: the engine's config, its rank, the rendezvous, and its KV pool's size."""

    config: EngineConfig
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int
    num_blocks: int
    block_size: int
    kv_groups: tuple[KVCacheGroup, ...] = ()  # several, or a sliding one: a block table each
    cpus: tuple[int, ...] | None = None  # the CPUs this rank's threads are bound to (cpu_sets.py); None: any


def run_worker(spec: WorkerSpec, connection: Connection, heartbeat: Any) -> None:
    """The spawned worker's whole life. It reports on the pipe: ("ok", None) once started, ("ok", (its weight
    bytes, its KV cache's bytes)) once loaded, or ("error", the traceback) instead of either. heartbeat: the shared
    value it beats while it runs (engine/rank_watchdog.py)."""
    # A terminal's Ctrl-C reaches the whole process group: the engine decides when its ranks stop, not the key.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.cpus is not None:
        BoundCpus().bind(spec.cpus)  # for the process's life: the threads it starts from here on inherit them
    start_heartbeat(heartbeat)
    try:
        torch.set_num_threads(spec.num_threads)
        connection.send(("ok", None))
        # env:// style: rank 0's TCPStore at MASTER_ADDR:MASTER_PORT, as torchrun or a Kubernetes pod would give.
        store = TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size)
        share, report = load_share(spec.config, spec.rank, spec.num_blocks, spec.block_size, spec.kv_groups)
        connection.send(("ok", report))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        raise
    serve_steps(share, connection)
    dist.destroy_process_group()


@dataclass
class RankShare:
    """What a worker rank holds: its share of the model and of the KV pool, its part of the KV connector, and its
    adapter slots (each None where the engine has none)."""

    execution: ModelExecution
    connector: OffloadingWorker | None = None
    adapters: AdapterSlots | None = None


def load_share(config: EngineConfig, rank: int, num_blocks: int, block_size: int,
               kv_groups: tuple[KVCacheGroup, ...] = ()) -> tuple[RankShare, RankReport]:
    """A worker rank's share of the model, the KV pool, the KV connector and the adapters, in a process that has
    joined the group; with what it holds and runs, for the engine's report."""
    placement = place_rank(config, rank, TORCH_DTYPES[config.dtype])
    model = load_engine_model(config, placement.parallel, placement.stage)
    cache = config.cache
    execution = ModelExecution(model, num_blocks, block_size, config.device, cache.cache_dtype,
                               cache.calculate_kv_scales, placement.links, kv_groups)
    connector = None if config.kv_transfer_config is None else build_rank_worker(
        config, kv_layer_tensors(execution.kv_caches), block_size, rank)
    share = RankShare(execution, connector, attach_engine_lora(config, model))
    return share, rank_report(model, execution.kv_caches)


def serve_steps(share: RankShare, connection: Connection) -> None:
    """Runs what the engine sends until it says stop or goes away, then lets go of the connector's resources."""
    try:
        run_steps(share, connection)
    finally:
        if share.connector is not None:
            share.connector.shutdown()


def run_steps(share: RankShare, connection: Connection) -> None:
    """Runs the steps (and the KV connector's and the adapter slots' calls on this rank's share) the engine sends
    until it says stop or goes away. A step that raises ends the process (the exception propagates): its sockets
    close, so rank 0's collective fails at once instead of waiting."""
    while True:
        try:
            message = pickle.loads(connection.recv_bytes())
        except EOFError:
            return  # the engine's end of the pipe closed: it has gone
        if message is None:
            return
        if isinstance(message, KVConnectorCall):
            assert share.connector is not None, "a KV connector call to a rank built without one"
            message.apply(share.connector)
            continue
        if isinstance(message, AdapterSlotsCall):
            assert share.adapters is not None, "an adapter call to a rank built without LoRA"
            message.apply(share.adapters)
            continue
        assert isinstance(message, ModelStep)
        share.execution.run(message)
