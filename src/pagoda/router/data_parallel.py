"""`pagoda serve --data-parallel-size N`: data parallelism on one machine without a launcher to write.

N engine processes (`pagoda serve` each, on loopback ports of their own, `--threads` split evenly between
them, each bound to CPUs of its own unless `--cpu-threads-bind nobind` or the machine has too few: pagoda.cpu_sets)
behind the router on the port the user asked for. Every other serve flag given passes to each engine
as it was given. With --kv-events-config, engine i publishes on the endpoint's port + i (vLLM's
convention for data-parallel ranks) and the router follows every engine's events.

With --tenant-config the router is the one front: it holds the tenants' token buckets (the limits hold for the
whole server, not per engine) and passes each request on with its key and tenant header; every engine gets the
same file with --no-tenant-rate-limits, so it finds the same tenant for its weight, adapters, cache namespace and
KV quota without counting its limits again. SIGHUP reloads the file in the router and in every engine.

SIGTERM or SIGINT stops the router (which finishes what it has in flight), then each engine (which drains for
--shutdown-timeout). An engine that exits on its own is down to the router; when all have, the router stops.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagoda.cpu_sets import split_cpus
from pagoda.router.config import RouterConfig

if TYPE_CHECKING:
    from pagoda.tenant_door import Tenants

logger = logging.getLogger("pagoda.serve")

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # prctl(2)
# Flags the parent decides for each engine, or that only the parent uses.
PARENT_ONLY = {"host", "port", "threads", "data_parallel_size", "kv_events_config", "tenant_rate_limits", "func",
               "command", "help"}


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The options of `args` that differ from the parser's defaults, written as a command line again."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = action.option_strings[0]  # then its --no- form
            argv.append(positive if value else f"--no-{positive[2:]}")
        elif action.nargs == 0:  # store_true and its kind
            argv.append(flag)
        elif isinstance(value, list):  # append
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def offset_port(endpoint: str, rank: int) -> str:
    """tcp://host:PORT -> tcp://host:PORT+rank, as vLLM offsets a data-parallel rank's KV-event endpoint."""
    base, _, port = endpoint.rpartition(":")
    if not base.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"--data-parallel-size with KV events needs a tcp://host:port endpoint, not {endpoint!r}")
    return f"{base}:{int(port) + rank}"


def split_threads(total: int, size: int) -> int:
    return max(1, total // size)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _start_engine(cpus: tuple[int, ...] | None) -> None:
    """In the engine, before it runs (Linux): SIGTERM when the parent dies, however it dies (even SIGKILL),
    so that no engine outlives the router it served; and bound to its CPUs, if given."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the engines outlive a killed parent
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


class Engines:
    """The engine processes: started, watched, stopped."""

    def __init__(self, commands: Sequence[list[str]], drain_timeout: float,
                 cpus: Sequence[tuple[int, ...]] | None = None) -> None:
        """cpus: each engine's CPUs, which it and its ranks (which split them between them) run on."""
        self.drain_timeout = drain_timeout
        # Sessions of their own: a terminal's Ctrl-C reaches the parent only, which then stops each engine once
        # (a second signal would make an engine skip its drain). Started before any thread of the parent's.
        self.processes = [subprocess.Popen(command, start_new_session=True,
                                           preexec_fn=functools.partial(_start_engine, None if cpus is None
                                                                        else cpus[index]))
                          for index, command in enumerate(commands)]
        self.stopping = False

    def watch(self) -> None:
        """Runs in a thread: when every engine has exited (and no stop was asked), stop the router too."""
        while not self.stopping and any(p.poll() is None for p in self.processes):
            time.sleep(0.5)
        if not self.stopping:
            logger.error("every engine process has exited: stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    def signal(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def stop(self) -> int:
        """SIGTERM to each (they drain), then wait; the first nonzero exit code, else 0."""
        self.stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout + 10
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return next((p.returncode for p in self.processes if p.returncode), 0)


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """What the parent starts: one command per engine, their URLs, and where each publishes KV events."""

    commands: list[list[str]]
    urls: list[str]
    cpus: list[tuple[int, ...]] | None  # each engine's CPUs (pagoda.cpu_sets), or None: the OS places them
    event_endpoints: dict[str, str]
    events_topic: str


def plan_engines(serve_parser: argparse.ArgumentParser, args: argparse.Namespace) -> EnginePlan:
    """Raises ValueError for a configuration that cannot be split (before anything starts)."""
    from pagoda.wire.kv_events import KVEventsConfig

    size = args.data_parallel_size
    threads = split_threads(args.threads or os.cpu_count() or 1, size)
    cpus = None if args.cpu_threads_bind == "nobind" else split_cpus(os.sched_getaffinity(0), size, threads)
    shared = given_flags(serve_parser, args, PARENT_ONLY)
    events = KVEventsConfig.from_dict(args.kv_events_config) if args.kv_events_config is not None else None
    urls = [f"http://{LOOPBACK}:{free_port()}" for _ in range(size)]
    commands, endpoints = [], {}
    for rank, url in enumerate(urls):
        command = [sys.executable, "-m", "pagoda", "serve", *shared, "--host", LOOPBACK,
                   "--port", url.rsplit(":", 1)[1], "--threads", str(threads)]
        if args.tenant_config:  # the router counts the limits, once
            command.append("--no-tenant-rate-limits")
        if events is not None:
            endpoint = offset_port(events.endpoint, rank)
            command += ["--kv-events-config", json.dumps({**dataclasses.asdict(events), "endpoint": endpoint})]
            if events.publishes:
                endpoints[url] = endpoint.replace("*", LOOPBACK)
        commands.append(command)
    return EnginePlan(commands, urls, cpus, endpoints, events.topic if events is not None else "")


def serve_data_parallel(plan: EnginePlan, args: argparse.Namespace, tenants: Tenants | None = None) -> int:
    """The router checks the keys the engines were given (flags, file, environment: the same for each; with
    tenants, theirs too), and sends them the first of those: any other would do as well, and the polls need one
    under --guard-metrics. tenants: the door the router admits requests by (the engines then get each client's
    own key)."""
    from pagoda.api_keys import ApiKeys
    from pagoda.router.launcher import serve_router

    logger.info("data parallel: %d engines behind the router on %s:%d", len(plan.urls), args.host, args.port)
    engines = Engines(plan.commands, args.shutdown_timeout, plan.cpus)
    threading.Thread(target=engines.watch, name="pagoda-engines", daemon=True).start()
    api_keys = tenants.keys if tenants is not None else ApiKeys.from_args(args)
    if tenants is not None:
        def reload(_signum: int, _frame: object) -> None:
            tenants.reload()
            engines.signal(signal.SIGHUP)

        signal.signal(signal.SIGHUP, reload)
    try:
        serve_router(RouterConfig(), plan.urls, tokenizer_dir=args.model, host=args.host, port=args.port,
                     log_level=args.uvicorn_log_level, event_endpoints=plan.event_endpoints,
                     events_topic=plan.events_topic, api_keys=api_keys,
                     replica_api_key=api_keys.keys[0].decode() if api_keys.enabled else None, tenants=tenants)
    finally:
        code = engines.stop()
    return code
