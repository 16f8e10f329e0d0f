"""Who gets in: API keys (401), admission control at the waiting-queue bound (429 with Retry-After), and a
model without a chat template (400 on chat, completions still served).

One server for the module, as tight as it gets: --max-num-seqs 1 and --max-waiting-requests 1, so one
long request running and one waiting fill it, deterministically; a 4096-token context lets the running one
last as long as a test needs (it is aborted by closing its stream), which also makes a client's disconnect
certain to reach the engine long before such a request could end by itself.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server

pytestmark = pytest.mark.timeout(120)

MODEL = "pagoda-admission"
KEY = "sekret-key"
PROMPT = "Hello world"
LONG = 3000  # tokens: far longer than any test needs the blocker to run
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-admission")
    model_dir = make_server_checkpoint(root / "model", chat_template=False, max_position_embeddings=4096)
    server = start_server(
        model_dir, root, "--num-kv-blocks", "260", "--block-size", "16", "--max-num-seqs", "1",
        "--max-waiting-requests", "1", "--max-model-len", "4096", served_model_name=MODEL, api_key=KEY,
    )
    yield server
    server.stop()


def running_and_waiting(server) -> tuple[float, float]:
    metrics = server.metrics()
    return metrics.gauge("vllm:num_requests_running"), metrics.gauge("vllm:num_requests_waiting")


async def start_blocker(aclient: openai.AsyncOpenAI):
    """A long streamed request, running (its first chunk is in) once this returns. Close it to abort it."""
    stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, stream=True,
                                              extra_body={"ignore_eos": True})
    await stream.__aiter__().__anext__()
    return stream


async def wait_for(server, running: int, waiting: int) -> None:
    await asyncio.to_thread(
        server.wait_for_metrics,
        lambda m: (m.gauge("vllm:num_requests_running"), m.gauge("vllm:num_requests_waiting")) == (running, waiting),
        f"{running} running and {waiting} waiting",
    )


def assert_rate_limited(error: openai.RateLimitError) -> None:
    assert error.status_code == 429
    assert error.response.headers.get("retry-after") is not None
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.body["type"] == "RateLimitError" and error.body["code"] in (429, "429"), error.body


# --------------------------------------------------------------------------------------------------
# API key
# --------------------------------------------------------------------------------------------------


def test_v1_routes_need_the_api_key(server):
    with server.client(api_key="wrong-key") as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with server.client() as right:
        assert [m.id for m in right.models.list().data] == [MODEL]
        assert right.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert_openai_error(response, 401)
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "messages": CHAT},
                              headers=headers, timeout=30)
        assert_openai_error(response, 401)
        assert_openai_error(httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30), 401)
    # Probes and scrapes stay open (as vLLM's): load balancers and Prometheus carry no key.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


# --------------------------------------------------------------------------------------------------
# No chat template
# --------------------------------------------------------------------------------------------------


def test_chat_without_a_chat_template_is_400_and_completions_still_work(server):
    with server.client() as client:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert "chat template" in raised.value.message
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].finish_reason

    response = server.post("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert_openai_error(response, 400, param="messages", contains=["chat template"])
    assert_openai_error(server.post("/tokenize", {"messages": CHAT}), 400, contains=["chat template"])
    assert server.post("/tokenize", {"prompt": PROMPT}).status_code == 200


# --------------------------------------------------------------------------------------------------
# Admission control
# --------------------------------------------------------------------------------------------------


def test_a_full_waiting_queue_answers_429_with_retry_after(server):
    async def main():
        async with server.async_client() as aclient:
            blocker = await start_blocker(aclient)
            waiting = asyncio.create_task(aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3))
            await wait_for(server, running=1, waiting=1)

            with pytest.raises(openai.RateLimitError) as completion_refused:
                await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            with pytest.raises(openai.RateLimitError) as stream_refused:
                await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True)
            raw = await asyncio.to_thread(server.post, "/v1/completions",
                                          {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
            assert (await asyncio.to_thread(running_and_waiting, server)) == (1, 1)  # nothing was admitted

            await blocker.close()  # aborts the blocker: the waiting request runs
            served = await waiting
            after = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        return completion_refused.value, stream_refused.value, raw, served, after

    completion_refused, stream_refused, raw, served, after = asyncio.run(main())
    assert_rate_limited(completion_refused)
    assert_rate_limited(stream_refused)
    assert_openai_error(raw, 429)
    assert raw.headers["retry-after"] == "1"
    assert served.usage.completion_tokens == 3
    assert after.usage.completion_tokens == 3
    server.wait_until_idle()


def test_bursts_past_the_queue_bound_get_429s_and_the_rest_is_served(server):
    """Bursts of simultaneous requests while one runs: each burst admits exactly one (to wait), refuses the
    rest with 429; once the runner is gone, everything refused is served on retry. Streams are used so an
    admitted request answers at once (headers) and can be aborted between rounds."""
    burst, rounds = 16, 3

    async def open_stream(aclient, seed: int):
        try:
            return await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, seed=seed,
                                                    temperature=1.0, stream=True, extra_body={"ignore_eos": True})
        except openai.RateLimitError as error:
            return error

    async def bursts(aclient) -> tuple[list[tuple[int, int]], list, list[int]]:
        admitted_per_round = []
        for round_index in range(rounds):
            results = await asyncio.gather(*(open_stream(aclient, seed) for seed in range(burst)))
            admitted = [r for r in results if not isinstance(r, openai.RateLimitError)]
            refused = [seed for seed, r in enumerate(results) if isinstance(r, openai.RateLimitError)]
            for result in results:
                if isinstance(result, openai.RateLimitError):
                    assert_rate_limited(result)
            admitted_per_round.append((len(admitted), len(refused)))
            if round_index < rounds - 1:
                for stream in admitted:
                    await stream.close()  # aborts it: the next burst starts from an empty queue
                await wait_for(server, running=1, waiting=0)
        return admitted_per_round, admitted, refused

    async def main():
        async with server.async_client() as aclient:
            blocker = await start_blocker(aclient)
            try:
                admitted_per_round, admitted, refused = await bursts(aclient)
                assert admitted_per_round == [(1, burst - 1)] * rounds, (
                    f"(admitted, refused) per burst: {admitted_per_round}: --max-waiting-requests 1 was exceeded")
                await wait_for(server, running=1, waiting=1)
            finally:
                await blocker.close()
            first_served = [chunk async for chunk in admitted[0]]

            # The refused ones retry (as a client honouring Retry-After would, with a shorter wait) until served.
            retries = 0

            async def until_served(seed: int):
                nonlocal retries
                for _ in range(500):
                    try:
                        return await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, seed=seed,
                                                                temperature=1.0, extra_body={"ignore_eos": True})
                    except openai.RateLimitError:
                        retries += 1
                        await asyncio.sleep(0.02)
                raise AssertionError("never served")

            rest = await asyncio.gather(*(until_served(seed) for seed in refused))
        return first_served, rest, retries

    first_served, rest, retries = asyncio.run(main())
    assert first_served[-1].choices[0].finish_reason == "length"
    assert len(rest) == burst - 1
    assert all(r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length" for r in rest)
    assert retries > 0  # the retries ran past the bound too, and were still all served
    server.wait_until_idle()


# --------------------------------------------------------------------------------------------------
# Clients that go away
# --------------------------------------------------------------------------------------------------


def assert_aborted_not_finished(before, after) -> None:
    """A finished request would have moved these counters; an aborted one moves only the abort count."""
    assert after.value("vllm:generation_tokens_total") == before.value("vllm:generation_tokens_total"), (
        "the request ran to its end after its client had gone"
    )
    assert after.value("vllm:request_success_total", finished_reason="length") == before.value(
        "vllm:request_success_total", finished_reason="length"
    )


def test_client_disconnect_aborts_a_streamed_request_and_frees_its_blocks(server):
    server.wait_until_idle()
    before = server.metrics()
    with server.client() as client:
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert server.metrics().gauge("vllm:num_requests_running") == 1
        stream.close()
    assert_aborted_not_finished(before, server.wait_until_idle())  # idle includes: every KV block back


def test_client_disconnect_aborts_a_non_streamed_request_too(server):
    """A client that gives up (its timeout, a closed connection) must not leave the engine generating."""
    server.wait_until_idle()
    before = server.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            request = asyncio.create_task(http.post("/v1/completions", json=body))
            await wait_for(server, running=1, waiting=0)
            request.cancel()  # closes its connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(main())
    assert_aborted_not_finished(before, server.wait_until_idle())
