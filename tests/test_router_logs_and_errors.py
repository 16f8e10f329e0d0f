"""What `pagoda route` prints: one line for a wrong --tokenizer, and an idle log that says only what changes
(the polls of /health and /metrics are DEBUG; a replica coming up is INFO)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from server_fixtures import LOOPBACK, free_port, wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MIN_POLLS = 10


class FakeReplica(BaseHTTPRequestHandler):
    """/health 200 and an empty /metrics: a replica that is up and idle. Counts the requests it answers."""

    polls: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).polls.append(self.path)
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[str]:
    FakeReplica.polls = []
    server = ThreadingHTTPServer((LOOPBACK, 0), FakeReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_wrong_tokenizer_directory_is_one_line_and_exit_2(tmp_path: Path):
    wrong = tmp_path / "no-such-model"
    done = subprocess.run([sys.executable, "-m", "pagoda", "route", "--replica", f"http://{LOOPBACK}:9",
                           "--tokenizer", str(wrong)], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"pagoda route: {wrong}"), done.stderr
    assert "Traceback" not in done.stderr


def test_an_idle_router_logs_the_replica_coming_up_at_info_and_no_poll(replica: str, tmp_path: Path):
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "pagoda", "route", "--replica", replica, "--host", LOOPBACK,
                                    "--port", str(free_port()), "--poll-interval", "0.05"],
                                   stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_until(lambda: len(FakeReplica.polls) >= MIN_POLLS, 60, f"{MIN_POLLS} polls of the fake replica")
    finally:
        process.terminate()
        process.wait(timeout=20)
    lines = log_path.read_text().splitlines()
    assert f"INFO pagoda.route: replica {replica} is up" in lines, lines
    polled = [line for line in lines if "/health" in line or "/metrics" in line]
    assert not polled, polled
