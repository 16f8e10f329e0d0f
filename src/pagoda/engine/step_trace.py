"""A timeline of engine steps, as Chrome's Trace Event Format (JSON): open it in Perfetto or chrome://tracing.

While recording, each step is one complete event ("X") on the engine's track, its phases (schedule, execute,
update, outputs) nested inside it and laid end to end, so they add up to the step; the runner's parts of
`execute` (prepare, forward, grammar masks, sample) nest one level further. Each request is an async track
("b"/"e", one per request id) from its arrival to its last token, with an instant at its first token. A
server adds what happens after a step (`publish`: outputs handed to the streams). Not recording, every call
returns at its first test: the engine pays nothing for the seam.

Times are `time.monotonic()` (the clock of the requests' timelines), in microseconds from the recording's start.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pagoda.engine.api import EngineOutput, RequestOutput

ENGINE_TRACK = 1  # tid of the steps and their phases
REQUESTS_TRACK = 2  # tid the requests' async events are listed under
CATEGORIES = ("step", "phase", "part", "between steps")  # by depth: a step, its phases, the runner's parts


class StepTrace:
    def __init__(self) -> None:
        self.recording = False
        self._events: list[dict[str, Any]] = []
        self._origin = 0.0
        self._lock = threading.Lock()  # start/stop come from another thread than the steps
        self._step_start: float | None = None
        self._step_args: dict[str, Any] = {}
        self._phase: tuple[str, float] | None = None
        self._pid = os.getpid()

    # --- control (any thread) -------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            self._events = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": "pagoda engine"}},
                            {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": ENGINE_TRACK,
                             "args": {"name": "engine steps"}},
                            {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": REQUESTS_TRACK,
                             "args": {"name": "requests"}}]
            self._origin = time.monotonic()
            self.recording = True

    def stop(self) -> dict[str, Any]:
        """The trace document so far; recording ends."""
        with self._lock:
            self.recording = False
            events, self._events = self._events, []
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    # --- the engine's thread --------------------------------------------------------------------------

    def begin_step(self) -> None:
        if self.recording:
            self._step_start = time.monotonic()
            self._phase = ("schedule", self._step_start)

    def phase(self, name: str) -> None:
        """Ends the step's current phase and begins `name` where it ended."""
        if self.recording and self._phase is not None:
            now = time.monotonic()
            self._complete(self._phase[0], self._phase[1], now, depth=1)
            self._phase = (name, now)

    def describe_step(self, **args: Any) -> None:
        """What the step ran (tokens, requests): shown on its event."""
        if self.recording:
            self._step_args.update(args)

    def end_step(self, outputs: Sequence[EngineOutput]) -> None:
        if not self.recording or self._step_start is None or self._phase is None:
            return
        now = time.monotonic()
        self._complete(self._phase[0], self._phase[1], now, depth=1)
        self._complete("step", self._step_start, now, depth=0, args=self._step_args)
        self._step_start, self._phase, self._step_args = None, None, {}
        for output in outputs:
            if output.finished:
                self._request(output)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """A part of the current phase (the runner's), or, between steps, work of its own (a server's publish)."""
        if not self.recording:
            yield
            return
        started = time.monotonic()
        try:
            yield
        finally:
            self._complete(name, started, time.monotonic(), depth=2 if self._step_start is not None else 3)

    # --- events -----------------------------------------------------------------------------------------

    def _us(self, moment: float) -> float:
        return (moment - self._origin) * 1e6

    def _complete(self, name: str, start: float, end: float, depth: int, args: dict[str, Any] | None = None) -> None:
        event: dict[str, Any] = {"name": name, "cat": CATEGORIES[depth], "ph": "X", "ts": self._us(start),
                                 "dur": (end - start) * 1e6, "pid": self._pid, "tid": ENGINE_TRACK}
        if args:
            event["args"] = dict(args)
        with self._lock:
            if self.recording:
                self._events.append(event)

    def _request(self, output: EngineOutput) -> None:
        """A finished request's life on its own async track, from its timeline (each sample's, or an embedding
        request's, which ends with its prompt)."""
        lives = [(c.index, c.timeline, c.finish_reason) for c in output.outputs] \
            if isinstance(output, RequestOutput) else [(0, output.timeline, "embedded")]
        for index, timeline, finish_reason in lives:
            if timeline is None or timeline.arrival < self._origin or timeline.last_token is None:
                continue  # arrived before the recording began: its start is not in the trace
            track = {"cat": "request", "pid": self._pid, "tid": REQUESTS_TRACK,
                     "id": f"{output.request_id}-{index}"}
            events = [{"name": "request", "ph": "b", "ts": self._us(timeline.arrival), **track,
                       "args": {"prompt_tokens": timeline.num_prompt_tokens}}]
            if timeline.first_token is not None:
                events.append({"name": "first token", "ph": "n", "ts": self._us(timeline.first_token), **track})
            events.append({"name": "request", "ph": "e", "ts": self._us(timeline.last_token), **track,
                           "args": {"output_tokens": timeline.num_output_tokens,
                                    "finish_reason": finish_reason}})
            with self._lock:
                if self.recording:
                    self._events.extend(events)
