"""A tensor-parallel rank that dies ends the engine, not just a step: /health turns 503 and the requests in
flight end with an error within seconds, whether the rank died mid-stream or while the engine was idle, new
requests get a 503 naming the rank, and once the server is stopped no process of it is left."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from server_fixtures import start_server, wait_until
from test_tensor_parallel import wait_gone

DETECTION_S = 5.0


def read_proc(path: str) -> bytes:
    """A /proc file's contents, or nothing once its thread or process has gone."""
    try:
        return Path(path).read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = [int(c) for c in read_proc(f"{task}/children").split()]
            found += children
            frontier += children
    return found


def rank_pids(pid: int) -> list[int]:
    """The spawned tensor-parallel workers among a server's descendants."""
    return [child for child in descendants(pid) if b"spawn_main" in read_proc(f"/proc/{child}/cmdline")]


@pytest.mark.parametrize("when", ["mid-stream", "idle"])
def test_a_dead_rank_ends_the_engine_within_seconds(when, tmp_path):
    server = start_server(None, tmp_path, "--tensor-parallel-size", "2")
    try:
        everything = descendants(server.process.pid)
        (rank,) = rank_pids(server.process.pid)
        if when == "idle":
            os.kill(rank, signal.SIGKILL)
            killed_at = time.monotonic()
        else:
            body = {"model": "pagoda-demo", "prompt": "hello", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            events = []
            with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if not events:
                        os.kill(rank, signal.SIGKILL)
                        killed_at = time.monotonic()
                    events.append(line.removeprefix("data: "))
            ended_after = time.monotonic() - killed_at
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert ended_after < DETECTION_S, f"the stream ended {ended_after:.1f} s after the rank died"
            assert len(events) < 400, "the stream ran on after its rank died"
            assert error["code"] >= 500
        wait_until(lambda: server.health() == 503, DETECTION_S - (time.monotonic() - killed_at), "/health 503")
        refused = server.post("/v1/completions", {"model": "pagoda-demo", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1 exited" in refused.json()["error"]["message"]
    finally:
        server.stop()
    assert wait_gone([server.process.pid, *everything]) == []
