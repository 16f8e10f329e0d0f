"""`pagoda serve`: bind the port first, load the model behind it, drain on SIGTERM, exit 0.

The listener is up before the model loads, so load balancers see /health = 503 (not a refused
connection) while loading and while draining. uvicorn's own signal handling closes the listener first,
so SIGTERM is handled here: stop admitting, let in-flight requests finish (or abort them at the
timeout), then stop uvicorn. An idle server stops at once; once uvicorn and the engine thread have
stopped, the process ends without the interpreter's teardown (see exit_now).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

import uvicorn

from pagoda.api_keys import ApiKeys
from pagoda.config import EngineConfig
from pagoda.engine.api import KVEventSink, RequestRejected
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.engine import LLMEngine
from pagoda.lora_request import LoRARequest
from pagoda.model_dir import ModelLoadError
from pagoda.pooling import PoolingParams
from pagoda.sampling import SamplingParams
from pagoda.server.admission import Admission
from pagoda.server.api import build_app
from pagoda.server.kv_events import make_publisher
from pagoda.server.memory import IdleReclaimer, freeze_startup_objects, limit_malloc_arenas
from pagoda.server.metrics import ServerMetrics, cache_config_info
from pagoda.server.read_deadline import read_deadline_protocol
from pagoda.server.state import LoadedModel, ServerState
from pagoda.server.tenancy import Tenants, register_tenant_gauges
from pagoda.startup import startup_summary
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import load_tokenizer
from pagoda.wire.kv_events import KVEventsConfig
from pagoda.wire.limits import ServerLimits

logger = logging.getLogger("pagoda.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.pagoda_state = state
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, _frame: FrameType | None) -> None:
        """Replaces uvicorn's handler: no re-raise of the signal, so the exit code is 0."""
        if self.pagoda_state.draining:
            self.force_exit = sig == signal.SIGINT
            self.should_exit = True
            return
        self.pagoda_state.draining = True
        engine = self.pagoda_state.engine
        if engine is None or not engine.num_unfinished:
            logger.info("signal %d: idle, stopping", sig)
            self.should_exit = True
            return
        logger.info("signal %d: draining (health 503), up to %.0f s for in-flight requests", sig, self.drain_timeout)
        threading.Thread(target=self._drain, name="pagoda-drain", daemon=True).start()

    def _drain(self) -> None:
        engine = self.pagoda_state.engine
        deadline = time.monotonic() + self.drain_timeout
        while engine is not None and engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine is not None and engine.num_unfinished:
            logger.warning("drain timeout: aborting %d requests", engine.num_unfinished)
            engine.abort_all()
            time.sleep(0.2)  # let the aborts reach their streams
        self.should_exit = True


def load_engine(state: ServerState, engine_config: EngineConfig, on_error: Callable[[], None],
                url: str | None = None, kv_events: KVEventSink | None = None) -> None:
    """Runs in a thread while the port already answers 503. Ends with the start-up summary (served at url)."""
    try:
        started = time.monotonic()
        engine = LLMEngine(engine_config, kv_events=kv_events)
        for adapter in state.lora_modules.values():  # each --lora-modules entry loaded and checked before serving
            engine.add_lora(adapter)
        tokenizer = load_tokenizer(engine_config.model)
        _warm_up(engine)  # before the engine thread exists: only one thread may ever step an engine
        async_engine = AsyncEngine(engine)
        description = async_engine.description
        metrics = ServerMetrics(state.model_name, lambda: async_engine.stats, cache_config_info(description.kv_cache),
                                max_model_len=description.max_model_len)
        register_tenant_gauges(metrics.registry, state.tenants, lambda: async_engine.stats)
        state.loaded = LoadedModel(async_engine, tokenizer, metrics, TokenizerPool(tokenizer))
        freeze_startup_objects()  # the model, torch and the app: later collections only walk what requests made
        logger.info("model %s ready in %.1f s\n%s", state.model_name, time.monotonic() - started,
                    startup_summary(description, engine_config, state.model_name, url))
    except (ModelLoadError, RequestRejected) as error:  # the checkpoint's or an adapter's fault, named in the message
        logger.error("model load failed: %s", error)
        state.load_error = f"model load failed: {error}"
        on_error()
    except Exception as error:
        logger.exception("model load failed")
        state.load_error = f"model load failed: {error}"
        on_error()


def _warm_up(engine: LLMEngine) -> None:
    """One tiny generation (or embedding) before /health turns 200, so the first user does not pay for lazy init.
    Not with calculate_kv_scales: fp8's scales come from the first K/V written, which must be a real prompt's."""
    if engine.config.cache.calculate_kv_scales:
        return
    params = PoolingParams() if engine.config.runner == "pooling" else SamplingParams(max_tokens=2)
    engine.add_request("warmup", [engine.tokenizer.bos_token_id or 0] * 4, params)
    while engine.has_unfinished_requests():
        engine.step()


def serve(engine_config: EngineConfig, *, model_name: str, host: str, port: int, api_keys: ApiKeys,
          limits: ServerLimits, max_waiting_requests: int | None, drain_timeout: float, log_level: str = "info",
          tool_call_parser: str | None = None, reasoning_parser: str | None = None, web_ui: bool = True,
          kv_events: KVEventsConfig | None = None, builtin_model: bool = False,
          lora_modules: list[LoRARequest] | None = None, runtime_lora_updating: bool = False,
          profile_dir: Path | None = None, tenants: Tenants | None = None) -> int:
    limit_malloc_arenas()  # before the serving threads start (server/memory.py)
    state = ServerState(model_name=model_name, api_keys=api_keys, limits=limits,
                        admission=Admission(max_waiting_requests), tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, web_ui=web_ui, builtin_model=builtin_model,
                        lora_modules={module.lora_name: module for module in lora_modules or []},
                        runtime_lora_updating=runtime_lora_updating,
                        profile_dir=profile_dir, tenants=tenants or Tenants(api_keys))
    signal.signal(signal.SIGHUP, lambda _signum, _frame: state.tenants.reload())
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                            http=read_deadline_protocol(limits.request_read_timeout))
    server = DrainingServer(config, state, drain_timeout)
    failed = threading.Event()

    def on_error() -> None:
        failed.set()
        server.should_exit = True

    publisher = make_publisher(kv_events)  # before the engine: a taken events port fails the start at once
    threading.Thread(
        target=load_engine, args=(state, engine_config, on_error, f"http://{host}:{port}"), name="pagoda-load",
        daemon=True, kwargs={"kv_events": publisher},
    ).start()

    def engine_busy() -> bool:
        return state.engine is not None and state.engine.num_unfinished > 0

    reclaimer = IdleReclaimer(busy=lambda: bool(server.server_state.tasks) or engine_busy(),
                              served=lambda: server.server_state.total_requests).start()
    server.run()
    reclaimer.stop()
    if state.engine is not None:
        state.engine.shutdown()
    if publisher is not None:
        publisher.shutdown()
    return 1 if failed.is_set() else 0


def exit_now(code: int) -> NoReturn:
    """Ends the process once serving has stopped. The interpreter's own teardown (finalizing torch and
    transformers, freeing the KV pool object by object) takes seconds; nothing is left for it to do: the
    engine thread has stopped, responses are sent, and the logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
