"""Memory comes back once a burst of bad requests is over: the idle reclaimer's rules, and a real server whose
resident memory, after megabytes of invalid bodies, returns to near where it started."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
from server_fixtures import make_server_checkpoint, start_server, wait_until

from pagoda.server.memory import IdleReclaimer, limit_malloc_arenas, release_memory

pytestmark = pytest.mark.timeout(180)


class _Cycle:
    def __init__(self, payload: bytes) -> None:
        self.payload, self.me = payload, self


def test_release_memory_frees_cyclic_garbage_at_once():
    gc.disable()
    try:
        cycle = _Cycle(bytes(1 << 20))
        alive = weakref.ref(cycle)
        del cycle
        assert alive() is not None  # garbage, but only a collection finds it
        release_memory()
        assert alive() is None
    finally:
        gc.enable()


def test_malloc_arenas_are_limited_on_glibc():
    assert limit_malloc_arenas() is (Path("/lib/x86_64-linux-gnu/libc.so.6").exists() or
                                     Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists())


def test_the_reclaimer_releases_once_per_idle_period_after_work():
    state = {"busy": False, "served": 0}
    released = threading.Event()
    calls: list[float] = []

    def release() -> None:
        calls.append(time.monotonic())
        released.set()

    reclaimer = IdleReclaimer(busy=lambda: state["busy"], served=lambda: state["served"], settle_s=0.3,
                              release=release).start()
    try:
        time.sleep(1.5)
        assert calls == []  # idle from the start, nothing served: nothing to release
        state["busy"] = True
        state["served"] = 5
        time.sleep(1.0)
        assert calls == []  # never while busy
        state["busy"] = False
        idle_at = time.monotonic()
        assert released.wait(5)
        assert calls[0] - idle_at >= 0.3  # after the settle time
        time.sleep(1.5)
        assert len(calls) == 1  # once per idle period
        state["served"] = 6
        wait_until(lambda: len(calls) == 2, 5, "a release after more work")
    finally:
        reclaimer.stop()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_server_gives_back_what_a_burst_of_bad_bodies_took(tmp_path):
    """Each body is 200,000 chat messages (7 MB): parsed, then refused as more messages than the context
    holds; the refusal's exception references the parsed body through a cycle. Before the reclaimer, six of
    them left the idle server ~100 MiB larger until the interpreter's next full collection."""
    model_dir = make_server_checkpoint(tmp_path / "model", max_position_embeddings=256)
    server = start_server(model_dir, tmp_path, "--max-model-len", "256", "--num-kv-blocks", "32")
    try:
        time.sleep(3)  # the reclaimer's first release after start-up requests
        start = _rss_mib(server.process.pid)
        body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 200_000}).encode()
        with httpx.Client(base_url=server.url, timeout=60, headers={"content-type": "application/json"}) as http:
            for _ in range(6):
                assert http.post("/v1/chat/completions", content=body).status_code == 400
        peak = _rss_mib(server.process.pid)

        def back_near_start() -> bool:
            return _rss_mib(server.process.pid) < start + 40

        wait_until(back_near_start, 20, f"RSS back near {start:.0f} MiB (peak {peak:.0f}, now "
                                        f"{_rss_mib(server.process.pid):.0f})", interval=0.5)
    finally:
        server.stop()
