"""A rank of a split model that dies or hangs ends the engine: whichever stage it was on (the last, which sends
rank 0 the logits; the first, beside rank 0; a tensor-parallel rank inside a stage), /health turns 503 and the
requests in flight end with an error within 5 s, new requests get a 503 naming the rank, and once the server is
stopped no process of it is left. A hung rank (stopped: it runs nothing, closes nothing) is found by the
watchdog's heartbeats and killed, which the ranks waiting on it then see at once."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from server_fixtures import start_server, wait_until
from test_tensor_parallel import wait_gone
from test_tensor_parallel_failure import DETECTION_S, descendants, rank_pids

CASES = {
    # (flags, the rank hit, when, the signal: SIGKILL a death, SIGSTOP a hang)
    "pp2, last stage dies mid-stream": (("--pipeline-parallel-size", "2"), 1, "mid-stream", signal.SIGKILL),
    "tp2xpp2, last stage's second rank dies mid-stream": (("-tp", "2", "-pp", "2"), 3, "mid-stream", signal.SIGKILL),
    "tp2xpp2, first stage's second rank dies idle": (("-tp", "2", "-pp", "2"), 1, "idle", signal.SIGKILL),
    "pp2, last stage hangs mid-stream": (("--pipeline-parallel-size", "2"), 1, "mid-stream", signal.SIGSTOP),
    "tp2, a rank hangs idle": (("--tensor-parallel-size", "2"), 1, "idle", signal.SIGSTOP),
}


def stream_until_hit(server, pid: int, hit: signal.Signals) -> tuple[list[str], float, float]:
    """Streams a long completion, sends `pid` the signal `hit` at its first event; (the events, when the signal
    was sent, how long the stream went on after it)."""
    body = {"model": "pagoda-demo", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events: list[str] = []
    killed_at = 0.0
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                os.kill(pid, hit)
                killed_at = time.monotonic()
            events.append(line.removeprefix("data: "))
    return events, killed_at, time.monotonic() - killed_at


@pytest.mark.parametrize("case", list(CASES))
def test_a_dead_or_hung_rank_of_any_stage_ends_the_engine_within_seconds(case, tmp_path):
    flags, killed_rank, when, hit = CASES[case]
    server = start_server(None, tmp_path, *flags)
    try:
        everything = descendants(server.process.pid)
        # The workers are spawned in rank order (1, 2, ...), one after the other: their pids rise with the rank.
        workers = sorted(rank_pids(server.process.pid))
        assert len(workers) == (3 if "-pp" in flags and "-tp" in flags else 1)
        victim = workers[killed_rank - 1]
        if when == "idle":
            os.kill(victim, hit)
            killed_at = time.monotonic()
        else:
            events, killed_at, ended_after = stream_until_hit(server, victim, hit)
            assert events[-1] == "[DONE]"
            assert ended_after < DETECTION_S, f"the stream ended {ended_after:.1f} s after the rank died"
            assert len(events) < 400, "the stream ran on after its rank died"
            assert json.loads(events[-2])["error"]["code"] >= 500
        wait_until(lambda: server.health() == 503, DETECTION_S - (time.monotonic() - killed_at), "/health 503")
        refused = server.post("/v1/completions", {"model": "pagoda-demo", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        ending = "exited" if hit == signal.SIGKILL else "stopped answering"
        assert f"rank {killed_rank} {ending}" in refused.json()["error"]["message"]
    finally:
        server.stop()
    assert wait_gone([server.process.pid, *everything]) == []
