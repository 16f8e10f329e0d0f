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
from typing import Any, TypeVar

from pagoda.engine.api import (
    EmbeddingRequestOutput,
    EngineDeadError,
    EngineDescription,
    EngineOutput,
    EngineStats,
    RequestFailed,
    RequestOutput,
    TenantShare,
)
from pagoda.engine.engine import LLMEngine
from pagoda.lora_request import LoRARequest
from pagoda.pooling import PoolingParams
from pagoda.sampling import SamplingParams
from pagoda.structured.interface import GrammarStateError

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Consecutive failed steps after which the engine is declared dead (health turns 503).
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: EngineOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._stats = engine.stats()  # replaced, never mutated, by the engine thread
        self.description: EngineDescription = engine.describe()  # fixed for the engine's life
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

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def stats(self) -> EngineStats:
        """The engine's gauges and counters as of its last step (or idle wake-up)."""
        return self._stats

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raises RequestRejected for a request that can never run. Reads only config: safe on any thread."""
        self._engine.validate(prompt_ids, params, priority)

    def validate_embedding(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """Raises RequestRejected for an embedding request that can never run. Reads only config: safe on any
        thread."""
        self._engine.validate_embedding(prompt_ids, params)

    async def embed(self, request_id: str, prompt: str | list[int], params: PoolingParams,
                    cache_salt: str | None = None, priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's embedding (the pooling runner). Cancelling the wait aborts the request."""
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, prompt, params, cache_salt, priority))
        try:
            item = await stream.queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, EmbeddingRequestOutput)
        return item

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs until the last (finished) one. Closing the iterator aborts.
        lora_request: the LoRA adapter to run it with (None: the base model); tenant: whose it is."""
        if self.is_dead:
            raise EngineDeadError("the engine is not running")
        if params.kv_transfer_params is not None and params.kv_transfer_params.do_remote_prefill:
            # A decode replica pulls the prompt's KV before the engine sees the request: no step waits on it.
            await asyncio.to_thread(self._engine.pull_remote_kv, params, prompt, cache_salt, lora_request)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._submit(lambda: self._add(request_id, prompt, params, cache_salt, priority, lora_request, tenant))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, RequestOutput)  # the request was a generate request
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

    def start_trace(self) -> None:
        """Begins recording the engine's steps as a timeline (engine/step_trace.py); thread-safe."""
        self._engine.trace.start()

    def stop_trace(self) -> dict[str, Any]:
        """The timeline since start_trace, as a Trace Event Format document; recording ends."""
        return self._engine.trace.stop()

    async def reset_prefix_cache(self) -> int:
        """Forgets the prefix cache's free blocks (on the engine thread); returns how many."""
        return await self._on_engine_thread(self._engine.reset_prefix_cache)

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads and checks an adapter on the engine thread (RequestRejected says what is wrong with it)."""
        await self._on_engine_thread(lambda: self._engine.add_lora(lora_request))

    async def remove_lora(self, name: str) -> None:
        """Frees an adapter's weights on the engine thread; requests already on it finish."""
        await self._on_engine_thread(lambda: self._engine.remove_lora(name))

    async def _on_engine_thread(self, call: Callable[[], T]) -> T:
        """Runs `call` between two steps, where the engine's state may be touched; its result or error comes back."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = call()
            except Exception as error:  # handed back to the caller
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._submit(run)
        return await future

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # a step still running keeps its ranks: they go when the process does
            self._engine.shutdown()

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- engine thread -----------------------------------------------------------------------------

    def _add(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams, cache_salt: str | None,
        priority: int, lora_request: LoRARequest | None = None, tenant: TenantShare | None = None,
    ) -> None:
        try:
            self._engine.add_request(request_id, prompt, params, cache_salt, priority, lora_request, tenant)
        except Exception as error:  # a bad request must not touch the loop
            self._fail(request_id, RequestFailed(f"request failed: {error}", alone=True))

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._engine.abort_request(request_id)

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)
        self._engine.abort_request(request_id)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopped:
                self._drain_commands()
                if not self._engine.has_unfinished_requests():
                    self._engine.check_health()  # idle too: a lost rank turns health to 503 within a wait
                    self._engine.release_sent_blocks()
                    self._update_stats()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                try:
                    outputs = self._engine.step()
                    failures = 0
                except EngineDeadError:  # nothing to retry: the loop ends, and every stream with it
                    raise
                except Exception as error:
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    self._fail_all(RequestFailed(f"engine step failed: {error}"))
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    continue
                for request_id, failure in self._engine.pop_failures().items():
                    self._fail(request_id, RequestFailed(f"request failed: {failure}", alone=True,
                                                         by_constraint=isinstance(failure, GrammarStateError)))
                with self._engine.trace.span("publish"):  # the outputs handed to their streams
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

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
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
        self._stats = self._engine.stats()
