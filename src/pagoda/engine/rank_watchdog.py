"""Turning a hung rank into a dead one: each worker beats a heartbeat, and rank 0 kills a worker whose heart stops.

A rank that exits closes its sockets, so the ranks waiting on it fail at once and the executor sees it gone. A rank
that hangs (stopped, wedged) closes nothing: the others would wait in their collective or point-to-point receive
until gloo's timeout, minutes. So each worker runs a thread that writes the time into shared memory every
HEARTBEAT_INTERVAL_S; torch's kernels release the GIL, so a worker busy in a long step still beats, and only a
process that runs nothing at all stops. Rank 0's watchdog thread kills a worker silent for HANG_TIMEOUT_S: its
sockets then close, the step in flight fails, and the executor reports the rank as hung rather than exited.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.25
HANG_TIMEOUT_S = 3.0  # silent this long: hung (a starved thread still beats within milliseconds of its turn)


def start_heartbeat(heartbeat: Any) -> None:
    """In a worker: beats `heartbeat` (a shared double, multiprocessing's Value) for as long as the process runs."""

    def beat() -> None:
        while True:
            heartbeat.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine
            time.sleep(HEARTBEAT_INTERVAL_S)

    heartbeat.value = time.monotonic()
    threading.Thread(target=beat, name="pagoda-heartbeat", daemon=True).start()


class RankWatchdog:
    """Rank 0's watch over its workers' heartbeats (by rank), started once they are loaded. `hung` holds the ranks
    it killed, with how long each had been silent."""

    def __init__(self, heartbeats: Mapping[int, Any], processes: Mapping[int, BaseProcess],
                 timeout_s: float = HANG_TIMEOUT_S) -> None:
        self.heartbeats, self.processes, self.timeout_s = heartbeats, processes, timeout_s
        self.hung: dict[int, float] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pagoda-rank-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Idempotent; after it, no worker is killed for its silence (shutdown stops them on purpose)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        started = time.monotonic()
        while not self._stopped.wait(HEARTBEAT_INTERVAL_S):
            now = time.monotonic()
            for rank, heartbeat in self.heartbeats.items():
                silent = now - max(started, heartbeat.value)
                process = self.processes[rank]
                if silent > self.timeout_s and rank not in self.hung and process.is_alive():
                    logger.error("split-model rank %d has not answered for %.1f s: killed as hung", rank, silent)
                    self.hung[rank] = silent
                    process.kill()
