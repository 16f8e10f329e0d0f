"""Helpers for the KV offload tests: workloads, running them turn by turn, and a redis-server of the test's own.

redis-server is Debian's package (.ci/run installs it). Without it the Redis tests are skipped, except on CI
(`CI` set), where they fail: a CI that cannot run them must not pass in silence (as the chromium tests)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from server_fixtures import free_port

from pagoda import SamplingParams
from pagoda.engine.api import KVTierStats

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 250) for _ in range(length)] for _ in range(count)]


def run_turns(llm, turns: Sequence[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt alone, in order; offloaded saves finished before the next turn (saves are asynchronous, so
    without the wait a turn could miss a block the turn before is still saving: still exact, but counted)."""
    outputs = []
    for prompt in turns:
        outputs.append(list(llm.generate([prompt], params)[0].outputs[0].token_ids))
        wait_for_saves(llm)
    return outputs


def wait_for_saves(llm) -> None:
    if llm.engine.kv_connector is not None:
        llm.engine.kv_connector.worker.wait_for_saves()


def tier(llm, medium: str) -> KVTierStats:
    stats = llm.engine.stats().kv_connector
    assert stats is not None
    return next(t for t in stats.tiers if t.medium == medium)


# --------------------------------------------------------------------------------------------------
# redis-server
# --------------------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    path = os.environ.get("PAGODA_REDIS_SERVER") or shutil.which("redis-server")
    if path is None:
        message = "no redis-server binary: `apt-get install redis-server` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class RedisServer:
    """A redis-server of the test's own, persistence off, on a port it keeps across restarts."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the store dies as a crashed one does, mid-run."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
