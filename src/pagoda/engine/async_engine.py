"""AsyncEngine: runs LLMEngine.step() in a thread of its own and streams outputs to asyncio callers.

Why a thread and not a process: torch releases the GIL inside its kernels, so the event loop keeps
serving HTTP while a step computes, and outputs cross to it without serialisation. The engine is not
thread-safe, so every call into it happens on the engine thread; callers talk to it through a command
queue, and it answers through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagoda.engine.engine import LLMEngine
from pagoda.engine.output import RequestOutput
from pagoda.sampling import SamplingParams

logger = logging.getLogger(__name__)

# Consecutive failed steps after which the engine is declared dead (health turns 503).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    pass


class RequestFailed(RuntimeError):
    """The engine failed while handling this request (an internal error: HTTP 500)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class EngineStats:
    """What /metrics reads; written by the engine thread only."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # added by callers, removed by the engine thread
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    # --- caller side (event loop) ------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None or not self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs until the last (finished) one. Closing the iterator aborts."""
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, prompt, params, cache_salt, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def call(self, function: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Runs function(engine) on the engine thread (e.g. reset the prefix cache); awaitable."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = function(self.engine)
            except Exception as error:  # handed back to the caller
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._submit(run)
        return future

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- engine thread -----------------------------------------------------------------------------

    def _add(self, request_id: str, prompt, params: SamplingParams, cache_salt: str | None, stream: _Stream) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, cache_salt)
        except Exception as error:  # a bad request must not touch the loop
            self._fail(request_id, error)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)
        self.engine.abort_request(request_id)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopped:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._update_stats()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self.engine.step()
                    failures = 0
                except Exception as error:
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    self._fail_all(RequestFailed(f"engine step failed: {error}"))
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    continue
                for request_id, error in self.engine.pop_failures().items():
                    self._fail(request_id, RequestFailed(f"request failed: {error}"))
                self._dispatch(outputs)
                self._update_stats()
        except BaseException as error:
            self.dead_error = error
            logger.exception("engine loop died")
            self._fail_all(EngineDeadError(f"engine loop died: {error}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)

    def _update_stats(self) -> None:
        scheduler = self.engine.scheduler
        self.stats = EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self.engine.kv_cache.usage(),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_steps=self.stats.num_steps + 1,
        )
