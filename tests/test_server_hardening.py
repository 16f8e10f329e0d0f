"""What one client can ask of the server, bounded: body size (413), prompt characters before tokenizing,
sequences per request and the waiting queue taken whole (400 / 429), stop strings and logit_bias; strict
JSON types; invalid Unicode (400 naming the field); internal errors that do not echo internals; the
per-request deadline (--request-timeout); /health and small requests answering within a second while other
clients send maximal requests; and a prompt exit on SIGTERM when idle.

Two servers, launched together: `server` with tight limits, and `timed`, with a one-second request
timeout. Both run through a wrapper that can stop the engine thread (a prompt holding HOLD_TOKEN blocks
before its second token while the server's HOLD file exists), so that waiting requests and deadlines are
produced deterministically, not raced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time

import httpx
import openai
import pytest
from server_fixtures import LOOPBACK, assert_openai_error, launch_server, make_server_checkpoint, wait_until

from pagoda.server.admission import Admission
from pagoda.server.api import build_app
from pagoda.server.state import LoadedModel, ServerState
from pagoda.wire import OpenAIError

pytestmark = pytest.mark.timeout(180)

MODEL = "pagoda-hardening"
MAX_MODEL_LEN = 32768  # with 32 characters a token: prompts of up to 1M characters, seconds to tokenize
CHARS_PER_TOKEN = 32  # the default --max-chars-per-token
MAX_CHARS = MAX_MODEL_LEN * CHARS_PER_TOKEN
BODY_LIMIT = 2 << 20
MAX_SEQUENCES = 64
MAX_WAITING = 70
HOLD_TOKEN = 501
LATENCY_BOUND_S = 1.0

WRAPPER = r"""
import os, sys, time

from pagoda.cli import main
from pagoda.engine import output_processor

HOLD, HOLD_TOKEN = os.environ["PAGODA_TEST_HOLD"], int(os.environ["PAGODA_TEST_HOLD_TOKEN"])
add_token = output_processor.SequenceText.add_token


def add_token_with_hold(self, token_id):
    if HOLD_TOKEN in self.request.prompt_token_ids and self.request.num_output_tokens >= 2:
        while os.path.exists(HOLD):
            time.sleep(0.01)
    return add_token(self, token_id)


output_processor.SequenceText.add_token = add_token_with_hold
sys.exit(main(sys.argv[1:]))
"""

COMMON_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--num-kv-blocks", "4096",
               "--max-num-seqs", "128", "--max-num-batched-tokens", "1024")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-hardening")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    launched = {}
    for name, args in (("server", ("--max-request-body-bytes", str(BODY_LIMIT), "--max-sequences-per-request",
                                   str(MAX_SEQUENCES), "--max-waiting-requests", str(MAX_WAITING))),
                       ("timed", ("--request-timeout", "1"))):
        env = {"PAGODA_TEST_HOLD": str(root / f"hold-{name}"), "PAGODA_TEST_HOLD_TOKEN": str(HOLD_TOKEN)}
        launched[name] = launch_server(model_dir, root, *COMMON_ARGS, *args, served_model_name=MODEL,
                                       wrapper=WRAPPER, env=env)
        launched[name].extra["hold"] = root / f"hold-{name}"
    try:
        for server in launched.values():
            server.wait_for_health(200)
        yield launched
    finally:
        for server in launched.values():
            server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers["server"]


@pytest.fixture(scope="module")
def timed(servers):
    return servers["timed"]


def post_json(server, path: str, body: object) -> httpx.Response:
    """The body as Python's json.dumps writes it: non-ASCII as \\u escapes, lone surrogates included."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def raw_http(port: int, head: bytes, body_parts: list[bytes] = ()) -> tuple[int, bytes]:
    """Sends a request byte for byte (to control Content-Length and chunking), returns status and body."""
    with socket.create_connection((LOOPBACK, port), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered before reading it all: what we are testing
        received = b""
        while b"\r\n\r\n" not in received or len(received) < _content_end(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    status = int(received.split(b" ", 2)[1])
    return status, received.split(b"\r\n\r\n", 1)[1]


def _content_end(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return len(received) + 1


def completion_head(length: int | None, chunked: bool = False) -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
            f"{framing}\r\nConnection: close\r\n\r\n").encode()


# --------------------------------------------------------------------------------------------------
# Request body size
# --------------------------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    # A declared 100 MB body is refused on its headers alone: not a byte of it is sent.
    status, body = raw_http(server.port, completion_head(100_000_000))
    assert status == 413
    error = json.loads(body)["error"]
    assert error["type"] == "RequestTooLargeError" and error["code"] == 413 and str(BODY_LIMIT) in error["message"]

    # Chunked, with no length declared: refused once the bytes received pass the limit (the last, small
    # chunk passes it, so the server has read everything sent when it answers).
    pieces = [b'{"prompt": "' + b"a" * ((256 << 10) - 12)] + [b"a" * (256 << 10)] * 7 + [b"a" * 1024]
    assert sum(map(len, pieces[:-1])) == BODY_LIMIT
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces]
    status, body = raw_http(server.port, completion_head(None, chunked=True), chunks)
    assert status == 413, body
    assert json.loads(body)["error"]["code"] == 413

    # Just under the limit is read (and refused for what it says, not for its size).
    prompt = "a" * (BODY_LIMIT - 100)
    assert_openai_error(post_json(server, "/v1/completions", {"prompt": prompt}), 400, param="prompt")
    assert server.health() == 200


# --------------------------------------------------------------------------------------------------
# Prompt characters, sequences per request, the waiting queue
# --------------------------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_context_can_hold_is_400_before_tokenizing(server):
    too_long = "a" * (MAX_CHARS + 1)
    for path, body, param in [
        ("/v1/completions", {"prompt": too_long}, "prompt"),
        ("/v1/completions", {"prompt": ["short", too_long]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_CHARS // 2 + 1)}] * 2},
         "messages"),
        ("/tokenize", {"prompt": too_long}, "prompt"),
    ]:
        error = assert_openai_error(post_json(server, path, body), 400, param=param)
        assert str(MAX_MODEL_LEN) in error["message"] and "characters" in error["message"], error
    # At the bound it is tokenized (and then refused by the context length, which is the engine's word).
    error = assert_openai_error(post_json(server, "/v1/completions", {"prompt": "a b " * (MAX_CHARS // 4)}), 400)
    assert "maximum context length" in error["message"], error


def test_sequences_per_request_are_bounded(server):
    for body, param in [({"prompt": ["hi"] * (MAX_SEQUENCES + 1)}, "prompt"),
                        ({"prompt": ["hi"] * 8, "n": MAX_SEQUENCES // 8 + 1}, "n"),
                        ({"prompt": [[5, 6]] * 2, "n": MAX_SEQUENCES // 2 + 1}, "n")]:
        error = assert_openai_error(post_json(server, "/v1/completions", {**body, "max_tokens": 2}), 400,
                                    param=param)
        assert str(MAX_SEQUENCES) in error["message"], error
    # 1,000 prompts are refused on their count, before any of them is validated.
    error = assert_openai_error(post_json(server, "/v1/completions", {"prompt": ["hi"] * 1000, "n": 128}), 400,
                                param="prompt")
    assert "at most" in error["message"], error
    ok = post_json(server, "/v1/completions", {"prompt": ["hi"] * 8, "n": 8, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_SEQUENCES


def test_a_request_that_would_overfill_the_waiting_queue_is_refused_whole(server):
    """With the engine held, admitted sequences stay waiting: 64 + 6 fill the bound of 70 exactly; a request
    of 7 on top of 64 is refused whole (429, Retry-After) and reserves nothing."""
    hold = server.extra["hold"]
    hold.touch()

    async def stream(aclient, prompt, n: int = 1, max_tokens: int = 3):
        return await aclient.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=max_tokens, stream=True,
                                                extra_body={"ignore_eos": True})

    async def main():
        async with server.async_client() as aclient:
            held = await stream(aclient, [0, HOLD_TOKEN, 70, 71], max_tokens=8)
            await asyncio.to_thread(wait_until, lambda: server.metrics().gauge("vllm:num_requests_running") == 1,
                                    20, "the held request running")
            first = await stream(aclient, ["hi"] * 8, n=8)  # 64 sequences: admitted (headers are back)
            with pytest.raises(openai.RateLimitError) as refused:
                await stream(aclient, ["hi"] * 7)
            rest = await stream(aclient, ["hi"] * 3, n=2)  # 6 more: exactly the bound
            with pytest.raises(openai.RateLimitError) as one_more:
                await aclient.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            hold.unlink()
            done = []
            for opened in (held, first, rest):
                done.append([chunk async for chunk in opened])
        return refused.value, one_more.value, done

    try:
        refused, one_more, (held, first, rest) = asyncio.run(main())
    finally:
        hold.unlink(missing_ok=True)
    for error in (refused, one_more):
        assert error.status_code == 429 and int(error.response.headers["retry-after"]) >= 1
        assert error.body["type"] == "RateLimitError", error.body
    finished = lambda chunks: sum(1 for c in chunks for choice in c.choices if choice.finish_reason)  # noqa: E731
    assert (finished(held), finished(first), finished(rest)) == (1, 64, 6)
    server.wait_until_idle()


def test_admission_counts_the_whole_request_against_the_bound():
    admission = Admission(max_waiting=8)
    first = admission.admit(num_prompts=2, n=3)
    with pytest.raises(OpenAIError) as refused:
        admission.admit(num_prompts=1, n=3)  # 6 + 3 > 8: refused whole, nothing reserved
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    assert admission.num_waiting == 6
    second = admission.admit(num_prompts=2, n=1)
    assert admission.num_waiting == 8
    with pytest.raises(OpenAIError) as never:
        admission.admit(num_prompts=3, n=3)  # more than the queue can ever hold: a 400, not a 429 to retry
    assert never.value.status == 400 and never.value.param == "n"
    first.release(0)
    assert admission.num_waiting == 5
    first.release(), second.release(), first.release()
    assert admission.num_waiting == 0


# --------------------------------------------------------------------------------------------------
# Stop strings, logit_bias, strict types, invalid Unicode
# --------------------------------------------------------------------------------------------------


BOUNDED_FIELDS = [
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["ok", "x" * 1025]}, "stop"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
]


@pytest.mark.parametrize("overrides,param", BOUNDED_FIELDS, ids=[p + str(i) for i, (_, p) in enumerate(BOUNDED_FIELDS)])
def test_stop_strings_and_logit_bias_are_bounded(server, overrides, param):
    error = assert_openai_error(post_json(server, "/v1/completions", {"prompt": "hi", **overrides}), 400, param=param)
    assert "at most" in error["message"], error


def test_stop_strings_and_logit_bias_within_their_bounds_are_served(server):
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["\x00" + "x" * 1023] + ["\x01"] * 15,
            "logit_bias": {str(i): 0.5 for i in range(2, 512)}}
    response = post_json(server, "/v1/completions", body)
    assert response.status_code == 200, response.text


STRICT_TYPES = [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"echo": "true"}, "echo"),
    ({"prompt": [False]}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"n": True}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop_token_ids": [False]}, "stop_token_ids"),
    ({"ignore_eos": "false"}, "ignore_eos"),
]


@pytest.mark.parametrize("overrides,param", STRICT_TYPES, ids=[json.dumps(o) for o, _ in STRICT_TYPES])
def test_types_are_strict_on_the_wire(server, overrides, param):
    body = {"prompt": "hi", "max_tokens": 2, **overrides}
    assert_openai_error(post_json(server, "/v1/completions", body), 400, param=param)


def test_strict_types_still_take_json_integers_for_floats(server):
    response = post_json(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1})
    assert response.status_code == 200, response.text
    chat = post_json(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                      "logprobs": True, "top_logprobs": 2, "stream": False})
    assert chat.status_code == 200, chat.text


LONE = "\ud800"
INVALID_UNICODE = [
    ("/v1/completions", {"prompt": f"hi {LONE}"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", f"{LONE}x"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [LONE]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "user": "\udfff"}, "user"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {f"1{LONE}": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"a{LONE}"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", INVALID_UNICODE, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in
                                                                      enumerate(INVALID_UNICODE)])
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(server, path, body, param):
    error = assert_openai_error(post_json(server, path, {"max_tokens": 2, **body}), 400, param=param)
    assert "invalid Unicode" in error["message"], error


def test_raw_surrogate_bytes_are_400_and_escaped_emoji_are_fine(server):
    # UTF-8 does not encode surrogates, but Python's JSON decoder lets their bytes through.
    raw = b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'
    response = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400, param="prompt", contains=["invalid Unicode"])
    for prompt in ("smile \U0001F600", "한국어 텍스트"):  # an escaped surrogate pair; Hangul's \ud55c and 0xED byte
        response = post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert response.status_code == 200, response.text  # as UTF-8 bytes


# --------------------------------------------------------------------------------------------------
# Internal errors
# --------------------------------------------------------------------------------------------------


class _BrokenEngine:
    is_dead, dead_error = False, None

    @property
    def max_model_len(self) -> int:
        raise RuntimeError("secret detail: /srv/weights/model.safetensors")


def test_an_internal_error_is_500_with_a_request_id_and_no_internals(caplog):
    state = ServerState(model_name=MODEL)
    state.loaded = LoadedModel(_BrokenEngine(), tokenizer=None, metrics=None, tokenizers=None)  # type: ignore[arg-type]

    async def main():
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pagoda") as client:
            return await client.get("/v1/models")

    with caplog.at_level(logging.ERROR, logger="pagoda.server.api"):
        response = asyncio.run(main())
    error = assert_openai_error(response, 500)
    assert error["type"] == "InternalServerError"
    assert "secret" not in response.text and "RuntimeError" not in response.text and "/srv" not in response.text
    assert error["message"].startswith("internal error (request id req-"), error
    request_id = response.headers["x-request-id"]
    assert request_id in error["message"]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])


# --------------------------------------------------------------------------------------------------
# Latency isolation
# --------------------------------------------------------------------------------------------------


def test_health_and_small_requests_answer_within_a_second_while_others_send_maximal_requests(server):
    """One client sends a maximal body (2 MiB of token ids: decoded on a worker thread, then refused as
    longer than the context), another a maximal fan-out (64 sequences), a third a maximal text prompt (1M
    characters: seconds of tokenizing, then refused as longer than the context); all the while /health and a
    one-token completion on their own connections each answer within a second."""
    ids = b"[" + b"123, " * ((BODY_LIMIT - 64) // 5 - 1) + b"123]"
    maximal_ids = b'{"max_tokens": 1, "prompt": ' + ids + b"}"
    assert BODY_LIMIT - 64 < len(maximal_ids) <= BODY_LIMIT
    maximal_text = {"prompt": "a b " * (MAX_CHARS // 4), "max_tokens": 1}
    fan_out = {"prompt": [f"story {i}:" for i in range(8)], "n": 8, "max_tokens": 16, "ignore_eos": True,
               "temperature": 1.0, "seed": 1}
    latencies: list[tuple[str, float]] = []

    async def timed(name: str, request) -> httpx.Response:
        started = time.monotonic()
        response = await request
        latencies.append((name, time.monotonic() - started))
        return response

    async def main():
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as heavy, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as probe:
            assert (await probe.get("/health")).status_code == 200  # its connection is open before the load
            load = [asyncio.create_task(heavy.post("/v1/completions", content=maximal_ids, headers=headers)),
                    asyncio.create_task(heavy.post("/v1/completions", json=fan_out)),
                    asyncio.create_task(heavy.post("/v1/completions", json=maximal_text))]
            deadline = time.monotonic() + 120
            while not all(task.done() for task in load) and time.monotonic() < deadline:
                health = await timed("health", probe.get("/health"))
                small = await timed("completion", probe.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
                assert health.status_code == 200 and small.status_code == 200, small.text
            return await asyncio.gather(*load)

    ids_response, fan_response, text_response = asyncio.run(main())
    assert_openai_error(ids_response, 400, contains=["maximum context length"])
    assert fan_response.status_code == 200 and len(fan_response.json()["choices"]) == 64
    assert_openai_error(text_response, 400, contains=["maximum context length"])
    assert len(latencies) >= 2, latencies
    slowest = max(latencies, key=lambda item: item[1])
    assert slowest[1] < LATENCY_BOUND_S, f"slowest: {slowest}, all: {latencies}"
    server.wait_until_idle()


# --------------------------------------------------------------------------------------------------
# The deadline, and SIGTERM (the timed server: --request-timeout 1)
# --------------------------------------------------------------------------------------------------


def test_a_request_past_its_deadline_is_aborted_and_answered_with_an_error(timed):
    hold = timed.extra["hold"]
    hold.touch()
    body = {"model": MODEL, "prompt": [0, HOLD_TOKEN, 80, 81], "max_tokens": 8, "ignore_eos": True}
    try:
        started = time.monotonic()
        response = httpx.post(f"{timed.url}/v1/completions", json=body, timeout=30)
        elapsed = time.monotonic() - started
        error = assert_openai_error(response, 504, contains=["--request-timeout"])
        assert error["type"] == "TimeoutError"
        assert 0.9 < elapsed < 10, elapsed

        with httpx.stream("POST", f"{timed.url}/v1/completions", json={**body, "stream": True}, timeout=30) as stream:
            assert stream.status_code == 200
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 504, events
    finally:
        hold.unlink(missing_ok=True)
    metrics = timed.wait_until_idle()
    assert metrics.value("vllm:request_success_total", finished_reason="abort") >= 2
    quick = httpx.post(f"{timed.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert quick.status_code == 200, quick.text


def test_sigterm_when_idle_exits_0_within_a_second_and_a_half(timed):
    """Runs last: it ends the timed server. An idle keep-alive connection is open, as a client's pool leaves it."""
    with httpx.Client(base_url=timed.url, timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        timed.wait_until_idle()
        started = time.monotonic()
        timed.process.send_signal(signal.SIGTERM)
        code = timed.process.wait(timeout=30)
        elapsed = time.monotonic() - started
    assert code == 0, timed.log_tail()
    assert elapsed < 1.5, f"exit took {elapsed:.2f} s"


def test_every_limit_is_a_serve_flag_with_its_default_in_one_place():
    import dataclasses

    from pagoda.cli import SERVER_LIMITS, build_parser
    from pagoda.wire.limits import ServerLimits

    assert set(SERVER_LIMITS) == {f.name for f in dataclasses.fields(ServerLimits)}
    defaults = build_parser().parse_args(["serve"])
    assert all(getattr(defaults, name) is None for name in SERVER_LIMITS)  # ServerLimits' defaults apply
    given = build_parser().parse_args(["serve", "--max-request-body-bytes", "4M", "--max-chars-per-token", "8",
                                       "--max-sequences-per-request", "16", "--max-stop-strings", "4",
                                       "--max-stop-string-chars", "64", "--max-logit-bias", "10",
                                       "--request-timeout", "0", "--request-read-timeout", "5", "--api-key", "a",
                                       "--api-key", "b"])
    limits = ServerLimits(**{name: getattr(given, name) for name in SERVER_LIMITS})
    assert limits.max_request_body_bytes == 4 << 20 and limits.max_sequences_per_request == 16
    assert limits.request_read_timeout == 5.0
    assert given.api_key == ["a", "b"]
    assert ServerState(model_name=MODEL, limits=limits).deadline(arrival=1.0) is None  # 0: no deadline
    assert ServerState(model_name=MODEL).deadline(arrival=1.0) == 601.0
    with pytest.raises(ValueError):
        ServerLimits(max_request_body_bytes=0)
