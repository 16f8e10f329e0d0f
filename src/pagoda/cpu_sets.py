"""Which CPUs each of the processes pagoda starts on one machine runs on: the ranks of a split model, and the
engines of `serve --data-parallel-size`.

With `cpu_threads_bind="auto"` (the values of vLLM's VLLM_CPU_OMP_THREADS_BIND) process r of N, each given T
threads, runs on the r-th run of T of the CPUs its starter may use, every thread of it: its torch threads, its
kernels' and, on rank 0, the engine's own. Processes then neither share a core nor migrate onto another's, so a
step's all-reduce does not wait on a rank the OS parked behind another. Data-parallel engines split their CPUs
between their own ranks in turn. Where there are fewer CPUs than N x T nothing is bound (the OS balances an
oversubscribed machine better than a fixed split).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path


def split_cpus(available: Iterable[int], processes: int, threads: int) -> list[tuple[int, ...]] | None:
    """The CPUs of each process (in order): consecutive runs of `threads` of `available`; None if too few."""
    cpus = sorted(available)
    if processes * threads > len(cpus):
        return None
    return [tuple(cpus[index * threads:(index + 1) * threads]) for index in range(processes)]


class BoundCpus:
    """This process's threads bound to a rank's CPUs (`bind`), and given back what they had (`release`)."""

    def __init__(self) -> None:
        self.cpus: tuple[int, ...] = ()
        self._before: dict[int, set[int]] = {}
        self._everyone: set[int] = set()

    def bind(self, cpus: Sequence[int]) -> None:
        """Binds every thread the process has now to cpus; threads started later inherit their starter's CPUs."""
        self.cpus, self._everyone = tuple(cpus), os.sched_getaffinity(0)
        for thread in _threads():
            try:
                self._before[thread] = os.sched_getaffinity(thread)
                os.sched_setaffinity(thread, cpus)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                continue

    def release(self) -> None:
        """The bound threads get their CPUs back, and threads started since (bound by inheritance) the
        process's CPUs before `bind`."""
        if not self.cpus:
            return
        for thread in _threads():
            try:
                os.sched_setaffinity(thread, self._before.get(thread, self._everyone))
            except (ProcessLookupError, PermissionError):
                continue
        self.cpus, self._before = (), {}


def _threads() -> list[int]:
    """This process's threads (Linux: sched_setaffinity takes a thread's id)."""
    return [int(name) for name in os.listdir(Path("/proc/self/task"))]
