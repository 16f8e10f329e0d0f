"""Start and stop a server process for a benchmark: a free port, a log file, and a wait for /health.

Standard library only, so that scripts running in their own environment (fuzz.py, with schemathesis) can
use it as well as those in pagoda's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def start_server(command: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None,
                 ) -> tuple[subprocess.Popen, str]:
    """Run `command` (which must contain `--port P`) with its output in `log_path`; return once /health
    answers 200, or raise with the log's tail if the process exits or `timeout` seconds pass."""
    url = f"http://{HOST}:{command[command.index('--port') + 1]}"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {process.returncode}; {log_path}:\n{tail}")
        if healthy(url, timeout=2):
            return process, url
        time.sleep(0.2)
    stop_server(process)
    tail = log_path.read_text(errors="replace")[-3000:]  # the caller may delete the log with its directory
    raise RuntimeError(f"server not healthy after {timeout:.0f} s; {log_path}:\n{tail}")


def stop_server(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Signal the server, wait for it (killing it after `timeout` s); its exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
