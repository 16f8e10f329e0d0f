"""`pagoda route` over two real `pagoda serve` replicas on loopback: requests that fail the same way on every
replica (the client's fault: a 4xx, or a 5xx the replica marks `X-Pagoda-Error-Scope: request`) go back as
the replica answered them, while streams run, and eject nothing; a replica that is killed is still ejected
after --breaker-failures. The router checks its own keys and sends the replicas theirs.

The replicas let repeat counts past llguidance's means through the door (--grammar-max-repeat), so that one
poison fails in the engine, alone, while generating: a 400 the replica marks request-scoped, produced for
real (the 500 + scope path is covered against fake replicas in test_router_faults.py).

Health polls are an hour apart once the first has found both replicas up: what the router does here is the
circuit breaker's doing, not the poller's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest
from server_fixtures import (
    LOOPBACK,
    ServerProcess,
    assert_openai_error,
    free_port,
    launch_server,
    make_server_checkpoint,
    wait_until,
)

from pagoda.wire import ERROR_SCOPE_HEADER

pytestmark = pytest.mark.timeout(300)

MODEL = "pagoda-poison-test"
CLIENT_KEY = "router-client-key"
REPLICA_KEY = "replica-only-key"
BREAKER_FAILURES = 2
REPLICA_ARGS = ("--num-kv-blocks", "512", "--block-size", "16", "--max-num-seqs", "32", "--max-model-len", "512",
                "--no-use-kernels", "--grammar-max-repeat", "5000000000", "--grammar-compile-timeout-s", "300")
NUM_STREAMS = 20
STREAM_TOKENS = 256  # long enough that the streams are still running when the poison has been answered
NUM_POISON = 10
CHAT = [{"role": "user", "content": "river stone cloud"}]
# (route, body, the replica's status, whether the replica marks it request-scoped): refused by each replica
# whatever it holds, the request's own fault.
POISON = [
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 5}, 400, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, 400, False),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "x{4294967295}"}}, 400, True),
]


def launch_router(replicas: list[ServerProcess], log_dir) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "route", "--policy", "round_robin", "--host", LOOPBACK,
               "--port", str(port), "--poll-interval", "3600", "--retry-backoff", "0.01",
               "--breaker-failures", str(BREAKER_FAILURES), "--breaker-cooldown", "3600", "--api-key", CLIENT_KEY]
    for replica in replicas:
        command += ["--replica", replica.url]
    log_path = log_dir / "router.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PAGODA_REPLICA_API_KEY": REPLICA_KEY}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    router = ServerProcess(process, port, MODEL, log_path, api_key=CLIENT_KEY)
    try:
        router.wait_for_health(200)
        wait_until(lambda: router.metrics().value("pagoda_router_replica_up") == len(replicas), 30,
                   "the router to find every replica up")
    except BaseException:
        router.stop()
        raise
    return router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("router-poison")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=512)
    replicas = [launch_server(model_dir, root, *REPLICA_ARGS, served_model_name=MODEL, api_key=REPLICA_KEY)
                for _ in range(2)]
    router = None
    try:
        for replica in replicas:
            replica.wait_for_health(200)
            for route, body, status, _ in POISON:  # compiled once here (seconds), so the test's poison answers fast
                assert replica.post(route, body).status_code == status
        router = launch_router(replicas, root)
        yield replicas, router
    finally:
        for process in [*([router] if router else []), *replicas]:
            process.stop()


async def stream_chat(http: httpx.AsyncClient, started: asyncio.Event, open_streams: list[int]) -> bytes:
    """One streamed chat to its end; `started` is set on its first chunk, open_streams[0] counts the open ones."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    received = b""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        open_streams[0] += 1
        try:
            async for chunk in response.aiter_bytes():
                received += chunk
                started.set()
        finally:
            open_streams[0] -= 1
    return received


async def streams_and_poison(router: ServerProcess) -> tuple[list[bytes], list[httpx.Response], int, int]:
    """NUM_STREAMS streams; once each has its first chunk, NUM_POISON poison requests at once. Returns the
    streams' bodies, the poison's answers, and how many streams were open when the poison was sent and when
    the last of it was answered."""
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    async with httpx.AsyncClient(base_url=router.url, headers=headers, timeout=120) as http:
        open_streams = [0]
        starts = [asyncio.Event() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(stream_chat(http, started, open_streams)) for started in starts]
        await asyncio.wait_for(asyncio.gather(*(started.wait() for started in starts)), 120)
        open_at_send = open_streams[0]
        poison = await asyncio.gather(*(http.post(POISON[i % len(POISON)][0], json=POISON[i % len(POISON)][1])
                                        for i in range(NUM_POISON)))
        still_open = open_streams[0]
        bodies = await asyncio.gather(*streams)
    return list(bodies), list(poison), open_at_send, still_open


def test_poison_ejects_nothing_while_streams_run_and_a_killed_replica_is_still_ejected(fleet):
    replicas, router = fleet
    before = router.metrics()
    bodies, poison, open_at_send, still_open = asyncio.run(streams_and_poison(router))

    assert open_at_send == NUM_STREAMS and still_open > 0, "the poison was sent and answered while streams ran"
    for body in bodies:
        events = [e for e in body.decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
        assert len(events) > STREAM_TOKENS // 2, "the stream ran to its end"
    for index, response in enumerate(poison):  # each the replica's own answer, passed through
        _, _, status, scoped = POISON[index % len(POISON)]
        assert_openai_error(response, status)
        assert (response.headers.get(ERROR_SCOPE_HEADER) == "request") == scoped
    metrics = router.metrics()
    assert metrics.value("pagoda_router_ejections_total") == 0
    assert metrics.value("pagoda_router_retries_total") == 0, "nothing moved to another replica"
    for replica in replicas:
        assert metrics.value("pagoda_router_replica_up", replica=replica.url) == 1
    assert metrics.value("pagoda_router_requests_total") - before.value("pagoda_router_requests_total") \
        == NUM_STREAMS + NUM_POISON

    with router.http() as http:
        for index in range(20):  # the next requests all succeed, on both replicas
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
            assert response.status_code == 200, (index, response.text)
        assert http.get("/health").status_code == 200
    served = router.metrics()
    for replica in replicas:
        assert served.value("pagoda_router_requests_total", replica=replica.url) \
            - metrics.value("pagoda_router_requests_total", replica=replica.url) == 10

    # The router's keys are its own: no key, or the replicas' key, is refused at the door.
    for headers in ({}, {"Authorization": f"Bearer {REPLICA_KEY}"}):
        response = httpx.post(f"{router.url}/v1/chat/completions", headers=headers, timeout=30,
                              json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
        assert response.status_code == 401, response.text

    # A replica that stops answering is ejected after --breaker-failures connection failures, and the
    # requests it fails are served by the other.
    victim, survivor = replicas
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=30)
    with router.http() as http:
        for index in range(2 * BREAKER_FAILURES + 2):
            response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
            assert response.status_code == 200, (index, response.text)
    after = router.metrics()
    assert after.value("pagoda_router_ejections_total", replica=victim.url) == 1
    assert after.value("pagoda_router_replica_up", replica=victim.url) == 0
    assert after.value("pagoda_router_retries_total", replica=victim.url, reason="connection") == BREAKER_FAILURES
    assert after.value("pagoda_router_ejections_total", replica=survivor.url) == 0
