"""`pagoda serve --data-parallel-size N`: the flags each engine gets are the ones the user gave (so an engine
parses to the same options), threads split evenly, KV-event ports offset by rank as vLLM does; and a real
run: two engines behind the router, answering, and all gone after SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import httpx
import pytest
from server_fixtures import launch_server, make_server_checkpoint, wait_until

from pagoda.cli import build_parser
from pagoda.cpu_sets import split_cpus
from pagoda.router import data_parallel, launcher
from pagoda.router.data_parallel import (
    PARENT_ONLY,
    given_flags,
    offset_port,
    plan_engines,
    serve_data_parallel,
    split_threads,
)

pytestmark = pytest.mark.timeout(240)


def serve_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


USER_FLAGS = ["--model", "/m", "--dtype", "bfloat16", "--no-enable-prefix-caching", "--use-kernels",
              "--num-kv-blocks", "64", "--kv-cache-memory-bytes", "3M", "--api-key", "a", "--api-key", "b",
              "--guard-metrics", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
              "--shutdown-timeout", "12", "--served-model-name", "m"]


def test_each_engine_parses_to_the_options_the_user_gave():
    parser = serve_parser()
    args = parser.parse_args([*USER_FLAGS, "--data-parallel-size", "2", "--threads", "6", "--port", "9000"])
    again = parser.parse_args(given_flags(parser, args, PARENT_ONLY))
    shared = {k: v for k, v in vars(args).items() if k not in PARENT_ONLY}
    assert shared == {k: v for k, v in vars(again).items() if k not in PARENT_ONLY}
    assert again.port != 9000 and again.data_parallel_size == 1, "the parent's own flags stay with it"


def test_threads_split_evenly_and_event_ports_offset_by_rank():
    assert split_threads(8, 2) == 4 and split_threads(3, 2) == 1 and split_threads(1, 4) == 1
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    with pytest.raises(ValueError, match="tcp"):
        offset_port("ipc:///tmp/events", 1)
    parser = serve_parser()
    args = parser.parse_args(["--model", "/m", "--data-parallel-size", "2", "--threads", "4", "--kv-events-config",
                              '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000"}'])
    plan = plan_engines(parser, args)
    assert [c[c.index("--threads") + 1] for c in plan.commands] == ["2", "2"]
    assert list(plan.event_endpoints.values()) == ["tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"]
    assert list(plan.event_endpoints) == plan.urls


def engine_cpus(parent_pid: int) -> list[set[int]]:
    """The CPUs of each process the parent started (every thread of each), in pid order."""
    children = sorted(int(pid) for task in Path(f"/proc/{parent_pid}/task").iterdir()
                      for pid in (task / "children").read_text().split())
    return [set.union(*(os.sched_getaffinity(int(thread.name)) for thread in Path(f"/proc/{pid}/task").iterdir()))
            for pid in children]


@pytest.mark.parametrize(("flags", "replica_key"), [(["--api-key", "a", "--api-key", "b"], "a"), ([], None)])
def test_the_engines_router_checks_their_keys_and_sends_them_one(monkeypatch, flags, replica_key):
    class NoEngines:
        def __init__(self, commands, drain_timeout, cpus=None) -> None:
            pass

        def watch(self) -> None:
            pass

        def stop(self) -> int:
            return 0

    routed = {}
    monkeypatch.setattr(data_parallel, "Engines", NoEngines)
    monkeypatch.setattr(launcher, "serve_router", lambda *args, **kwargs: routed.update(kwargs))
    for name in ("PAGODA_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    parser = serve_parser()
    args = parser.parse_args(["--model", "/m", "--data-parallel-size", "2", *flags])
    assert serve_data_parallel(plan_engines(parser, args), args) == 0
    keys = routed["api_keys"]
    assert keys.enabled == bool(flags) and routed["replica_api_key"] == replica_key
    assert not flags or (keys.accepts("Bearer a") and keys.accepts("Bearer b") and not keys.accepts("Bearer c"))


def test_two_engines_serve_behind_the_router_and_stop_with_it(tmp_path):
    model_dir = make_server_checkpoint(tmp_path / "model")
    server = launch_server(model_dir, tmp_path, "--data-parallel-size", "2", "--threads", "2", "--num-kv-blocks", "64",
                           "--no-use-kernels", "--max-model-len", "256", served_model_name="dp")

    def engines_up() -> list[str]:
        metrics = server.metrics()
        up = [labels["replica"] for labels in metrics.labels_of("pagoda_router_replica_up")
              if metrics.value("pagoda_router_replica_up", **labels) == 1]
        return up if len(up) == 2 else []

    try:
        server.wait_for_health(200)
        engines = wait_until(engines_up, 120, "both engines up")
        # Each engine on a CPU of its own where there are two (--threads 2 splits into one thread an engine).
        expected = split_cpus(os.sched_getaffinity(server.process.pid), 2, 1)
        assert engine_cpus(server.process.pid) == (
            [os.sched_getaffinity(server.process.pid)] * 2 if expected is None else [set(cpus) for cpus in expected])
        with server.client() as client:
            for _ in range(4):
                response = client.completions.create(model="dp", prompt=[5, 6, 7], max_tokens=2)
                assert response.usage.completion_tokens == 2
        assert server.metrics().value("pagoda_router_requests_total") == 4
    finally:
        server.stop()
    assert server.process.returncode == 0
    for url in engines:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


def test_no_engine_outlives_a_killed_parent(tmp_path):
    model_dir = make_server_checkpoint(tmp_path / "model")
    server = launch_server(model_dir, tmp_path, "--data-parallel-size", "2", "--threads", "2", "--num-kv-blocks", "64",
                           "--no-use-kernels", "--max-model-len", "256", served_model_name="dp")
    try:
        server.wait_for_health(200)
        engines = [labels["replica"] for labels in server.metrics().labels_of("pagoda_router_replica_up")]
        assert len(engines) == 2
    finally:
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=10)

    def all_gone() -> bool:
        for url in engines:
            try:
                httpx.get(f"{url}/health", timeout=1)
                return False
            except httpx.TransportError:
                pass
        return True

    wait_until(all_gone, 60, "the engines to stop after their parent was killed")
