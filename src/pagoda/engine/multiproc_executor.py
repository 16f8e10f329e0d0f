"""MultiprocExecutor: one model split across N processes, one rank each: tensor-parallel ranks, in one pipeline
stage or several (engine/rank_placement.py says which rank holds what). The workers are spawned here, on this
machine; or, under an external launcher, started by it, perhaps on other machines (engine/external_ranks.py).

Rank 0 is the engine's own process: the scheduler, KV manager, detokenizer, sampler and grammars stay there and
never know N, and rank 0 runs its share of every step beside the workers, ranks 1..N-1, which are started here
(torch.multiprocessing, spawn; engine/tp_worker.py). The ranks meet as torch.distributed's env://
rendezvous has them meet, on loopback (MASTER_ADDR, MASTER_PORT: a TCPStore rank 0 opens on a free port), and
the forward's collectives run on gloo. `--threads` is split evenly across the ranks.

Each step reaches the workers once: rank 0 pickles the step's ModelStep and writes it to each worker's pipe. A
pipe rather than a broadcast, because a worker waiting for the next step then waits without a collective's
timeout (an idle server would otherwise time its workers out), and sees the engine go (end of file) however it
ends, killed included, so that no worker outlives it. Shutdown (`shutdown`, the executor's collection, or the
interpreter's exit) asks each worker to stop, then kills any that has not within a few seconds.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pickle
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # (not in torch's __all__)

from pagoda.config import EngineConfig
from pagoda.cpu_sets import BoundCpus, split_cpus
from pagoda.engine.api import EngineDeadError, KVEventSink
from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.scheduler import SchedulerOutput
from pagoda.engine.executor import Executor
from pagoda.engine.external_ranks import connect_workers
from pagoda.engine.grammar_masks import StructuredOutputs
from pagoda.engine.kv_connector.base import KVConnector
from pagoda.engine.kv_connector.offload import BlockHashes
from pagoda.engine.kv_connector.split import build_split_connector
from pagoda.engine.lora_manager import AdapterSlots, AdapterSlotsCall, LoRAManager
from pagoda.engine.model_step import (
    ModelExecution,
    ModelStep,
    RankReport,
    attach_engine_lora,
    kv_layer_tensors,
    load_engine_model,
)
from pagoda.engine.rank_placement import place_rank
from pagoda.engine.rank_watchdog import RankWatchdog
from pagoda.engine.runner import DraftModel, ModelRunner
from pagoda.engine.step_trace import StepTrace
from pagoda.engine.tp_worker import STARTUP_TIMEOUT_S, STOP, WorkerSpec, run_worker
from pagoda.kv_groups import KVCacheGroup
from pagoda.model.kv_cache import LayerKV
from pagoda.model.loader import TORCH_DTYPES
from pagoda.model.lora_checkpoint import LoRAAdapter

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
STOP_TIMEOUT_S = 5.0  # a worker asked to stop that is still there after this is killed
# After a failed step: how long a rank whose sockets closed may take to be seen as exited (it closes them
# while exiting, a moment before it is reaped).
RANK_EXIT_WAIT_S = 1.0


@dataclass
class Worker:
    rank: int
    process: BaseProcess | None  # None: started by an external launcher, perhaps on another machine
    connection: Connection


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int,
                 structured: StructuredOutputs | None = None, draft: DraftModel | None = None,
                 trace: StepTrace | None = None, block_hashes: BlockHashes | None = None,
                 kv_events: KVEventSink | None = None, kv_groups: tuple[KVCacheGroup, ...] = ()) -> None:
        """block_hashes, kv_events: the KV manager's, for the KV connector config.kv_transfer_config names.
        kv_groups: the KV cache groups when there are several or a sliding one (model_step.ModelExecution)."""
        world_size = config.parallel.world_size
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed process group (one split engine per "
                               "process)")
        self._parallel = config.parallel
        self._workers: list[Worker] = []
        heartbeats: dict[int, Any] = {}
        self._watchdog = RankWatchdog(heartbeats, {})
        threads_before = torch.get_num_threads()
        self._bound = BoundCpus()
        self._stop = weakref.finalize(self, _stop_workers, self._workers, self._watchdog, threads_before,
                                      self._bound)
        threads = max(1, threads_before // world_size)
        try:
            if config.parallel.executor_backend == "external_launcher":
                threads = threads_before  # each launched process was given its own threads
                connections = connect_workers(config, num_blocks, block_size, kv_groups)
                self._workers += [Worker(rank, None, connections[rank]) for rank in sorted(connections)]
            else:
                cpu_sets = None if config.parallel.cpu_threads_bind == "nobind" else split_cpus(
                    os.sched_getaffinity(0), world_size, threads)
                self._spawn_workers(config, num_blocks, block_size, kv_groups, threads, heartbeats, cpu_sets)
                if cpu_sets is not None:  # after the spawns: a child starts on its parent's CPUs
                    self._bound.bind(cpu_sets[0])
            placement = place_rank(config, 0, TORCH_DTYPES[config.dtype])
            model = load_engine_model(config, placement.parallel, placement.stage)
            # What each worker holds and runs, in rank order.
            self._worker_reports: list[RankReport] = [_receive(worker, "loading its share")
                                                      for worker in self._workers]
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d ranks (tensor parallel %d x pipeline parallel %d; rank 0 in this process), %d thread(s) "
                    "each%s", world_size, config.parallel.tensor_parallel_size,
                    config.parallel.pipeline_parallel_size, threads,
                    ", each rank on CPUs of its own" if self._bound.cpus else "")
        local = ModelExecution(model, num_blocks, block_size, config.device, config.cache.cache_dtype,
                               config.cache.calculate_kv_scales, placement.links, kv_groups)
        execution = BroadcastExecution(local, [worker.connection for worker in self._workers])
        stack = attach_engine_lora(config, model)
        lora = None if stack is None or config.lora is None else LoRAManager(
            config.lora, BroadcastAdapterSlots(stack, execution.send), stack.base_config)
        self.kv_connector: KVConnector | None = None
        if config.kv_transfer_config is not None:
            assert block_hashes is not None
            self.kv_connector = build_split_connector(config, kv_layer_tensors(local.kv_caches), block_size,
                                                      block_hashes, kv_events, execution.send)
        super().__init__(ModelRunner(execution, structured, draft, lora=lora, trace=trace,
                                     kv_connector=None if self.kv_connector is None else self.kv_connector.worker))
        self._watchdog.processes = {worker.rank: worker.process for worker in self._workers
                                    if worker.process is not None}
        self._watchdog.start()

    def _spawn_workers(self, config: EngineConfig, num_blocks: int, block_size: int,
                       kv_groups: tuple[KVCacheGroup, ...], threads: int, heartbeats: dict[int, Any],
                       cpu_sets: list[tuple[int, ...]] | None) -> None:
        """Starts ranks 1..N-1 as processes of this machine (each bound to its CPUs of cpu_sets, if given), and
        joins the group with them as rank 0."""
        world_size = config.parallel.world_size
        store = TCPStore(LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, world_size):
            ours, theirs = context.Pipe()
            spec = WorkerSpec(config, rank, world_size, LOOPBACK, store.port, threads, num_blocks, block_size,
                              kv_groups, None if cpu_sets is None else cpu_sets[rank])
            heartbeats[rank] = context.Value("d", 0.0, lock=False)
            process = context.Process(target=run_worker, args=(spec, theirs, heartbeats[rank]),
                                      name=f"pagoda-rank{rank}", daemon=True)
            process.start()
            theirs.close()  # the worker's end lives in the worker alone: its exit is our end of file
            self._workers.append(Worker(rank, process, ours))
        for worker in self._workers:
            _receive(worker, "starting")
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", store=store, rank=0, world_size=world_size)

    @property
    def tensor_parallel_size(self) -> int:
        return self._parallel.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self._parallel.pipeline_parallel_size

    def rank_reports(self) -> list[RankReport]:
        return [*super().rank_reports(), *self._worker_reports]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            return super().execute_model(scheduler_output)
        except Exception:
            # A rank that has gone explains any failure of the step (its sockets and pipe close as it
            # exits), and no later step can succeed: say so, so that the engine stops rather than retries.
            self.check_health(wait_s=RANK_EXIT_WAIT_S)
            raise

    def check_health(self, wait_s: float = 0.0) -> None:
        """Raises EngineDeadError if a worker has exited, waiting up to wait_s for one that is exiting. A spawned
        worker's exit is its process sentinel; a launched one's, its connection turning readable (it sends nothing
        once loaded, so readable means closed)."""
        ready = multiprocessing.connection.wait([_exit_signal(worker) for worker in self._workers], timeout=wait_s)
        if not ready:
            return
        gone = [worker for worker in self._workers if _exit_signal(worker) in ready
                and (worker.process is None or not worker.process.is_alive())]
        hung = [worker for worker in gone if worker.rank in self._watchdog.hung]
        if hung:
            rank = hung[0].rank
            raise EngineDeadError(f"split-model rank {rank} stopped answering (silent for "
                                  f"{self._watchdog.hung[rank]:.1f} s) and was killed: the model is incomplete")
        if gone:
            # A rank killed by a signal is the cause; ranks that exited on their own beside it most likely failed on
            # a collective with it (which of them the sentinels show first is a race).
            worker = min(gone, key=lambda w: not (w.process is not None and (w.process.exitcode or 0) < 0))
            how = ("its connection to rank 0 closed" if worker.process is None
                   else f"exit code {worker.process.exitcode}")
            raise EngineDeadError(f"split-model rank {worker.rank} exited ({how}): the model is incomplete")

    def worker_pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers
                if worker.process is not None and worker.process.pid is not None]

    def shutdown(self) -> None:
        self._stop()


class BroadcastExecution:
    """Rank 0's execution: each step goes to the workers, then rank 0 runs its own share of it with them."""

    def __init__(self, local: ModelExecution, connections: list[Connection]) -> None:
        self.local = local
        self.model = local.model
        self.kv_caches: list[LayerKV] = local.kv_caches
        self.block_size = local.block_size
        self.connections = connections

    def run(self, step: ModelStep) -> list[torch.Tensor]:
        self.send(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        return self.local.run(step)

    def send(self, message: bytes) -> None:
        """A pickled message to every worker, in order with the steps."""
        for connection in self.connections:
            connection.send_bytes(message)


class BroadcastAdapterSlots:
    """Rank 0's adapter slots: each call made on its own model's and sent to the workers', ahead of the step."""

    def __init__(self, local: AdapterSlots, send: Callable[[bytes], None]) -> None:
        self.local, self.send = local, send
        self._rows_sent = False  # whether the workers' last step had adapter rows

    def _broadcast(self, call: AdapterSlotsCall) -> None:
        self.send(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self._broadcast(AdapterSlotsCall("load", (slot, adapter)))
        self.local.load(slot, adapter)

    def begin_step(self, token_slots: Sequence[int] | None) -> None:
        if token_slots is not None or self._rows_sent:  # base-only after base-only: nothing for the workers to do
            self._broadcast(AdapterSlotsCall("begin_step", (None if token_slots is None else list(token_slots),)))
        self._rows_sent = token_slots is not None
        self.local.begin_step(token_slots)


def _receive(worker: Worker, doing: str) -> Any:
    """The worker's next report; raises if it failed, or exited without one."""
    exited = RuntimeError(f"split-model rank {worker.rank} exited while {doing} (a script that starts ranks "
                          "needs `if __name__ == \"__main__\":` around its code, as with any spawned process)")
    while not worker.connection.poll(0.2):
        if worker.process is not None and not worker.process.is_alive():
            raise exited
    try:
        status, payload = worker.connection.recv()
    except EOFError:
        raise exited from None
    if status != "ok":
        raise RuntimeError(f"split-model rank {worker.rank} failed while {doing}:\n{payload}")
    return payload


def _exit_signal(worker: Worker) -> Any:
    """What turns ready when the worker has gone: its process's sentinel, or for a launched worker its connection."""
    return worker.connection if worker.process is None else worker.process.sentinel


def _stop_workers(workers: list[Worker], watchdog: RankWatchdog, threads_before: int, bound: BoundCpus) -> None:
    """Asks every worker to stop, kills those still there after STOP_TIMEOUT_S, leaves the process group, and
    gives this process its threads and CPUs back."""
    watchdog.stop()
    for worker in workers:
        with contextlib.suppress(OSError):  # a worker that has gone has closed its end
            worker.connection.send_bytes(STOP)
    for worker in workers:
        if worker.process is not None:  # a launched worker is its launcher's to reap; STOP ends it
            worker.process.join(STOP_TIMEOUT_S)
            if worker.process.is_alive():
                logger.warning("split-model rank %d did not stop: killed", worker.rank)
                worker.process.kill()
                worker.process.join()
        worker.connection.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads_before)
    bound.release()
