"""The kernel build's lock is held by a live process only: a process killed while it holds the lock (or while
it compiles) never blocks the next one, which says what it waits for while the holder lives, and a build
killed midway leaves nothing that the next start trips over."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from pagoda.kernels import cpu_flags
from pagoda.kernels.build import build_lock

HOLDER = r"""
import sys, time
from pathlib import Path
from pagoda.kernels.build import build_lock

with build_lock(Path(sys.argv[1]), "test"):
    print("held", flush=True)
    time.sleep(600)
"""

# Builds the AVX2 module into the cache named by PAGODA_CACHE; exit 0 once it is loaded.
BUILD = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from pagoda.kernels import avx2_kernels
sys.exit(0 if avx2_kernels() is not None else 3)
"""
BUILD_TIMEOUT_S = 900  # a full build of the AVX2 module on a busy 2-core machine, with room to spare


def test_a_killed_holder_hands_the_lock_over_at_once(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        acquired = threading.Event()

        def wait_for_lock() -> None:
            with build_lock(tmp_path, "test"):
                acquired.set()

        with caplog.at_level(logging.WARNING, logger="pagoda.kernels"):
            waiter = threading.Thread(target=wait_for_lock, daemon=True)
            waiter.start()
            deadline = time.monotonic() + 10
            while f"waiting for process {holder.pid}" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert f"waiting for process {holder.pid}" in caplog.text  # never a silent wait
            assert not acquired.is_set()
            holder.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            assert acquired.wait(timeout=5), "the lock of a killed process was not taken over"
            assert time.monotonic() - killed_at < 2
            waiter.join(timeout=5)
        assert (tmp_path / "build.lock").read_text().strip() == str(os.getpid())
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 120)
@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags() or shutil.which("c++") is None,
                    reason="the AVX2 module needs an AVX2 CPU and a C++ compiler")
def test_a_start_after_a_build_killed_midway_builds_and_loads(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PAGODA_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("PAGODA_DISABLE_KERNELS", None)
    first_log = tmp_path / "first.log"
    with open(first_log, "wb") as log:  # its own session: the compilers it started are killed with it below
        first = subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        while not list(cache.glob("kernels/*/build-*/build.ninja")):  # the compilers are running
            assert first.poll() is None, first_log.read_text()
            assert time.monotonic() < deadline, "the first build never started compiling"
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        _kill_session(first)
    assert "compiling pagoda's CPU kernels (pagoda_cpu_avx2_kernels)" in first_log.read_text()
    assert not list(cache.glob("kernels/*/*.so")), "the killed build left a module behind"

    started = time.monotonic()
    second = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT_S)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output
    assert "waiting for process" not in output  # the dead process's lock was not waited on
    assert "compiling pagoda's CPU kernels (pagoda_cpu_avx2_kernels)" in output
    assert not list(cache.glob("kernels/*/build-*")), "build directories were left behind"
    built = time.monotonic() - started

    third = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "compiling" not in third.stdout + third.stderr  # the finished module is reused
    recorded = json.loads((cache / "kernels" / "build-seconds.json").read_text())["pagoda_cpu_avx2_kernels"]
    assert 0 < recorded <= built  # the next build's message says how long this one took


def _kill_session(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
