"""Ranks started by an external launcher (torchrun, a Kubernetes LeaderWorkerSet, a job script), for
`--distributed-executor-backend external_launcher`.

Every rank runs the same command; the launcher tells each one its place through torch.distributed's env://
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 runs the engine (and the server, if the command
serves); every other rank becomes a worker, exactly as a spawned one (engine/tp_worker.py), and its command ends
when rank 0 stops or goes. A worker takes rank 0's engine config, not its own command's, so that every rank holds
the same model split the same way and the same KV pool, whatever each machine's own memory would have chosen.

Steps reach an external worker as they reach a spawned one, one pickled message per step in order, over a TCP
connection to rank 0 instead of a pipe (multiprocessing.connection). Rank 0 listens on every interface on a port
of its choosing and hands the port and a fresh authentication key to the workers over the process group: only
the ranks that joined the group can connect. The workers reach it at MASTER_ADDR, rank 0's address by the
launcher's own contract. A worker that exits closes its connection, which is how rank 0 sees it gone; a rank on
another machine has no heartbeat in shared memory, so one that hangs without exiting is found only by gloo's
collective timeout.
"""

from __future__ import annotations

import os
import secrets
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.kv_groups import KVCacheGroup

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place among the ranks, as the launcher gave it."""

    rank: int
    world_size: int
    master_addr: str


@dataclass(frozen=True)
class WorkerOffer:
    """What rank 0 hands every external worker over the process group: where and how to connect, and what to run."""

    port: int
    authkey: bytes
    config: EngineConfig
    num_blocks: int
    block_size: int
    kv_groups: tuple[KVCacheGroup, ...]


def launched_rank(world_size: int) -> LaunchedRank:
    """Reads this process's place from the launcher's environment; raises ValueError naming what is wrong."""
    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if missing:
        raise ValueError(f'distributed_executor_backend "external_launcher" needs the launcher\'s '
                         f'{", ".join(missing)} in the environment (torchrun sets them; see docs/parallelism.md)')
    rank, launched_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if launched_size != world_size:
        raise ValueError(f"the launcher started WORLD_SIZE={launched_size} ranks, but tensor_parallel_size x "
                         f"pipeline_parallel_size is {world_size}: they must be equal")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside 0..{world_size - 1}")
    return LaunchedRank(rank, world_size, os.environ["MASTER_ADDR"])


def run_if_worker_rank(config: EngineConfig) -> None:
    """Under the external launcher, a rank other than 0 serves rank 0 as a worker here and then ends the process
    (SystemExit 0); rank 0, and every other backend, returns at once to build the engine."""
    if config.parallel.executor_backend != "external_launcher":
        return
    place = launched_rank(config.parallel.world_size)
    if place.rank == 0:
        return
    from pagoda.engine.tp_worker import load_share, serve_steps

    # A terminal's Ctrl-C reaches every rank it started: rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dist.init_process_group("gloo", init_method="env://", rank=place.rank, world_size=place.world_size)
    received: list[WorkerOffer | None] = [None]
    dist.broadcast_object_list(received, src=0)
    offer = received[0]
    assert offer is not None
    connection = Client((place.master_addr, offer.port), authkey=offer.authkey)
    connection.send(place.rank)
    try:
        share, report = load_share(offer.config, place.rank, offer.num_blocks, offer.block_size,
                                         offer.kv_groups)
        connection.send(("ok", report))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        raise
    serve_steps(share, connection)
    dist.destroy_process_group()
    raise SystemExit(0)


def connect_workers(config: EngineConfig, num_blocks: int, block_size: int,
                    kv_groups: tuple[KVCacheGroup, ...]) -> dict[int, Connection]:
    """Rank 0's side: joins the process group the launcher set up, hands the workers the offer, and returns each
    worker's connection by rank once every one has connected."""
    place = launched_rank(config.parallel.world_size)
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=place.world_size)
    authkey = secrets.token_bytes(32)
    with Listener(("0.0.0.0", 0), authkey=authkey) as listener:
        offer = WorkerOffer(listener.address[1], authkey, config, num_blocks, block_size, kv_groups)
        dist.broadcast_object_list([offer], src=0)
        connections: dict[int, Connection] = {}
        while len(connections) < place.world_size - 1:
            connection = listener.accept()
            connections[int(connection.recv())] = connection
    return connections


__all__ = ["LAUNCHER_VARIABLES", "LaunchedRank", "connect_workers", "launched_rank", "run_if_worker_rank"]
