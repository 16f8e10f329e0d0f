"""A thread count that follows the cores a step can actually get: the busy-neighbour case.

Every parallel region of a step splits its work evenly over the torch threads and ends at a barrier, so when
another process keeps one of the cores busy the whole step waits for the thread that shares that core, and
the OS scheduler gives that thread only part of it. On two cores with one busy, two threads decode at
about a third of their idle speed while one thread, on the free core, keeps about two thirds. No start-up
choice suits both an idle and a shared machine, so the executor measures: from time to time, while the steps
keep one shape (the same requests and tokens, so their times compare), it runs a few steps with one thread
fewer (or more) and keeps that count if those steps were clearly faster.

Invariant: the count only changes between steps, from the thread that runs them (torch's thread count is that
thread's), and never above the count the engine started with.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

logger = logging.getLogger("pagoda")


@dataclass(frozen=True)
class TunerSettings:
    """probe_interval_s: the least time between two probes, doubled after each probe that keeps the count, up
    to max_probe_interval_s (an idle machine pays for fewer probes), and back to it after a change.
    probe_budget: the most of the steps' time spent at probed counts (probes wait until it allows them), so
    that long steps, whose shapes rarely repeat, cannot make probing a large cost.
    samples: steps timed on each side of a comparison (their medians compared).
    margin_down / margin_up: how much faster fewer / more threads must be to be kept. Fewer is held to more
    (noise on a shared machine reaches ~20%, and a wrong step down costs ~1.4x; a busy neighbour makes fewer
    threads 2x faster).
    slowdown: steps this much slower than at the last decision, same shape, start a probe at once (a
    neighbour that just arrived is not waited out).
    give_up: a probed step this much slower than the count's own ends its probe at once."""

    probe_interval_s: float = 1.0
    max_probe_interval_s: float = 4.0
    probe_budget: float = 0.02
    samples: int = 3
    margin_down: float = 0.25
    margin_up: float = 0.1
    slowdown: float = 1.5
    give_up: float = 2.0


class ThreadCountTuner:
    """Tells the executor how many threads to run each step with, from the times of the steps it ran."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 settings: TunerSettings | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if max_threads < 2:
            raise ValueError(f"a thread count adapts between 1 and max_threads >= 2, got {max_threads}")
        self.max_threads = self.threads = max_threads
        self.settings = settings or TunerSettings()
        self.switches = 0
        self._set_threads, self._clock = set_threads, clock
        self._shape: Hashable = None
        self._recent: deque[float] = deque(maxlen=self.settings.samples)  # this shape's steps at self.threads
        self._probe: int | None = None  # the count being tried on these steps
        self._probe_times: list[float] = []
        self._interval = self.settings.probe_interval_s
        self._next_probe_at = clock() + self._interval
        self._reference: tuple[Hashable, float] | None = None  # the shape and median step at the last decision
        self._going_down = True
        # How far the next probe in each direction goes: doubled after each probe there that found nothing
        # faster, since with two cores busy one thread fewer still waits on a shared core and two fewer do not.
        self._distance = {True: 1, False: 1}
        self._elapsed = self._probed = 0.0  # seconds of every step observed, and of those run at a probed count

    @property
    def running(self) -> int:
        """The thread count the next step runs with."""
        return self.threads if self._probe is None else self._probe

    def observe(self, shape: Hashable, seconds: float) -> None:
        """One step of `shape` (anything equal for steps whose times compare) took `seconds` at `running`."""
        self._elapsed += seconds
        if self._probe is not None:
            self._probed += seconds
        if shape != self._shape:
            self._shape = shape
            self._recent.clear()
            if self._probe is not None:  # the comparison's two sides would not be the same work: try again later
                self._set_threads(self.threads)
                self._probe, self._probe_times = None, []
                self._next_probe_at = self._clock() + self.settings.probe_interval_s
                return
        if self._probe is not None:
            self._probe_times.append(seconds)
            if seconds > self.settings.give_up * statistics.median(self._recent):
                self._end_probe(False, seconds)
            elif len(self._probe_times) == self.settings.samples:
                probed = statistics.median(self._probe_times)
                margin = self.settings.margin_down if self._going_down else self.settings.margin_up
                self._end_probe(probed < (1 - margin) * statistics.median(self._recent), probed)
            return
        self._recent.append(seconds)
        if len(self._recent) == self.settings.samples and self._should_probe():
            self._start_probe()

    def _should_probe(self) -> bool:
        reference = self._reference
        if reference is not None and reference[0] == self._shape and (
                statistics.median(self._recent) > self.settings.slowdown * reference[1]):
            return True
        return self._clock() >= self._next_probe_at and self._probed <= self.settings.probe_budget * self._elapsed

    def _start_probe(self) -> None:
        if self.threads == self.max_threads:
            self._going_down = True
        elif self.threads == 1:
            self._going_down = False
        else:
            self._going_down = not self._going_down
        room = self.threads - 1 if self._going_down else self.max_threads - self.threads
        step = min(self._distance[self._going_down], room)
        self._probe = self.threads - step if self._going_down else self.threads + step
        self._probe_times = []
        self._set_threads(self._probe)

    def _end_probe(self, keep: bool, probe_median: float) -> None:
        assert self._probe is not None
        if keep:
            logger.info("threads %d -> %d: a step of this batch took %.1f ms, now %.1f ms (another process is %s "
                        "the cores)", self.threads, self._probe, 1e3 * statistics.median(self._recent),
                        1e3 * probe_median, "using" if self._probe < self.threads else "leaving")
            self.threads, self.switches = self._probe, self.switches + 1
            self._recent = deque([probe_median] * self.settings.samples, maxlen=self.settings.samples)
            self._interval = self.settings.probe_interval_s
            self._distance = {True: 1, False: 1}
        else:
            self._set_threads(self.threads)
            self._interval = min(2 * self._interval, self.settings.max_probe_interval_s)
            self._distance[self._going_down] *= 2
        self._reference = (self._shape, statistics.median(self._recent))
        self._probe, self._probe_times = None, []
        self._next_probe_at = self._clock() + self._interval
