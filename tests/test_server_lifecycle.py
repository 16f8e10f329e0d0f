"""A server's life: 503 while the model loads, one request's failure contained to that request (500 in
OpenAI's shape while the others carry on), and SIGTERM: 503 while draining, in-flight requests finish,
exit code 0.

The server is the real `pagoda serve`, started through a small wrapper (`python -c WRAPPER serve ...`) that
adds three test hooks, all keyed on files or magic prompt tokens so the tests control timing instead of
racing it:
  - model loading waits until the LOAD_GATE file exists (the port is already bound: /health says 503);
  - a request whose prompt holds FAULT_TOKEN raises inside its output processing at its 4th token;
  - a request whose prompt holds HOLD_TOKEN stops the engine before its 2nd token while the HOLD file exists.
"""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest
from server_fixtures import assert_openai_error, launch_server, make_server_checkpoint, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "pagoda-lifecycle"
FAULT_TOKEN = 500
HOLD_TOKEN = 501
# Prompts as token ids (<s> then ordinary tokens), so none holds a magic token by accident.
PROMPTS = [[0, *range(40 + 7 * i, 47 + 7 * i)] for i in range(4)]
CHAT = [{"role": "user", "content": "hi"}]

WRAPPER = r"""
import os, sys, time

import pagoda.server.launcher as launcher
from pagoda.cli import main
from pagoda.engine import output_processor

LOAD_GATE, HOLD = os.environ["PAGODA_TEST_LOAD_GATE"], os.environ["PAGODA_TEST_HOLD"]
FAULT_TOKEN, HOLD_TOKEN = int(os.environ["PAGODA_TEST_FAULT_TOKEN"]), int(os.environ["PAGODA_TEST_HOLD_TOKEN"])


class GatedEngine(launcher.LLMEngine):
    def __init__(self, *args, **kwargs):
        deadline = time.monotonic() + 120
        while not os.path.exists(LOAD_GATE) and time.monotonic() < deadline:
            time.sleep(0.01)
        super().__init__(*args, **kwargs)


launcher.LLMEngine = GatedEngine
add_token = output_processor.SequenceText.add_token


def add_token_with_hooks(self, token_id):
    prompt = self.request.prompt_token_ids
    if FAULT_TOKEN in prompt and self.request.num_output_tokens >= 4:
        raise RuntimeError("injected fault")
    if HOLD_TOKEN in prompt and self.request.num_output_tokens >= 2:
        while os.path.exists(HOLD):
            time.sleep(0.01)
    return add_token(self, token_id)


output_processor.SequenceText.add_token = add_token_with_hooks
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-lifecycle")
    model_dir = make_server_checkpoint(root / "model")
    load_gate, hold = root / "load-gate", root / "hold"
    env = {"PAGODA_TEST_LOAD_GATE": str(load_gate), "PAGODA_TEST_HOLD": str(hold),
           "PAGODA_TEST_FAULT_TOKEN": str(FAULT_TOKEN), "PAGODA_TEST_HOLD_TOKEN": str(HOLD_TOKEN)}
    server = launch_server(model_dir, root, "--num-kv-blocks", "64", "--block-size", "16", "--max-num-seqs", "8",
                           "--shutdown-timeout", "30", served_model_name=MODEL, wrapper=WRAPPER, env=env)
    try:
        # The port answers before the model is loaded: what a client sees then.
        def loading() -> bool:
            if server.process.poll() is not None:
                raise AssertionError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
            return server.health() == 503

        wait_until(loading, 120, "/health 503 while the model loads")
        server.extra["while_loading"] = {
            "health": server.health(),
            "completions": server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
            "chat": server.post("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
            "tokenize": server.post("/tokenize", {"prompt": "hi"}),
        }
        load_gate.touch()
        server.wait_for_health(200)
        server.extra["hold"] = hold
        yield server
    finally:
        server.stop()


def test_health_is_503_while_the_model_loads(server):
    seen = server.extra["while_loading"]
    assert seen["health"] == 503
    for route in ("completions", "chat", "tokenize"):
        error = assert_openai_error(seen[route], 503)
        assert error["type"] == "ServiceUnavailableError", error
        assert "loading" in error["message"], error
    assert server.health() == 200


def test_a_failing_request_gets_500_and_the_others_carry_on(server):
    normal = [{"prompt": prompt, "max_tokens": 160, "temperature": 0.8, "seed": i, "extra_body": {"ignore_eos": True}}
              for i, prompt in enumerate(PROMPTS[:3])]
    with server.client() as client:
        alone = [client.completions.create(model=MODEL, **kwargs).choices[0].text for kwargs in normal]

    async def main():
        async with server.async_client() as aclient:
            streams = [await aclient.completions.create(model=MODEL, stream=True, **kwargs) for kwargs in normal]
            iterators = [stream.__aiter__() for stream in streams]
            firsts = [await it.__anext__() for it in iterators]  # all three are running now

            async def rest(first, iterator) -> tuple[str, str]:
                chunks = [first] + [chunk async for chunk in iterator]
                return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

            async def faulty_stream() -> tuple[int, BaseException | None]:
                received = 0
                try:
                    stream = await aclient.completions.create(
                        model=MODEL, prompt=[0, FAULT_TOKEN, 60, 61], max_tokens=32, stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    async for _ in stream:
                        received += 1
                except openai.APIError as error:
                    return received, error
                return received, None

            faulty = aclient.completions.create(model=MODEL, prompt=[0, 62, FAULT_TOKEN, 63], max_tokens=32,
                                                extra_body={"ignore_eos": True})
            return await asyncio.gather(faulty, faulty_stream(), *(rest(f, it) for f, it in zip(firsts, iterators)),
                                        return_exceptions=True)

    failed, (received, stream_error), *others = asyncio.run(main())

    assert isinstance(failed, openai.InternalServerError), failed
    assert failed.status_code == 500
    assert failed.body["type"] == "InternalServerError" and failed.body["code"] in (500, "500"), failed.body
    assert {"message", "type", "param", "code"} <= set(failed.body)
    assert_internal_error_logged(server, failed.body["message"])

    assert isinstance(stream_error, openai.APIError), stream_error
    assert received >= 1  # the error arrived mid-stream, after tokens
    assert_internal_error_logged(server, stream_error.body["message"])

    # The others finished, with exactly the text they get alone.
    assert others == [(text, "length") for text in alone]
    server.wait_until_idle()
    assert server.health() == 200
    with server.client() as client:
        assert client.completions.create(model=MODEL, **normal[0]).choices[0].text == alone[0]


def assert_internal_error_logged(server, message: str) -> None:
    """The client gets "internal error" and an id, never the failure's own text; the log has it under that id."""
    assert message.startswith("internal error (request id "), message
    assert "injected fault" not in message
    request_id = message.removeprefix("internal error (request id ").removesuffix(")")

    def logged() -> bool:
        return any(request_id in line and "injected fault" in line for line in server.log_tail(10**7).splitlines())

    wait_until(logged, 10, "the failure logged under its request id")


def test_sigterm_drains_in_flight_requests_then_exits_0(server):
    """Runs last: it ends the module's server."""
    hold = server.extra["hold"]
    hold.touch()
    with server.client() as client:
        stream = client.completions.create(model=MODEL, prompt=[0, HOLD_TOKEN, 70, 71], max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        # Running, and held before its second token. (Its first token may be half a character, which
        # streams no chunk: wait on the server's gauge, not on a first chunk.)
        wait_until(lambda: server.metrics().gauge("vllm:num_requests_running") == 1, 20, "the request running")
        server.process.send_signal(signal.SIGTERM)

        wait_until(lambda: server.health() == 503, 10, "/health 503 while draining")
        refused = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        error = assert_openai_error(refused, 503)
        assert error["type"] == "ServiceUnavailableError", error
        assert server.metrics().gauge("vllm:num_requests_running") == 1
        assert server.process.poll() is None, "the server must wait for its in-flight request"

        hold.unlink()
        chunks = list(stream)

    assert chunks[-1].usage.completion_tokens == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert server.process.wait(timeout=30) == 0, server.log_tail()
