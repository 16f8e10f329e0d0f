"""Prefix caching through the HTTP server: usage.prompt_tokens_details.cached_tokens, POST /reset_prefix_cache,
the vllm:prefix_cache_* counters, cache_salt, and `--no-enable-prefix-caching`.

The module needs the two settings of the flag, so it starts two tiny servers (same checkpoint, same pool,
one with --no-enable-prefix-caching), launched together and stopped at the end. Every test uses prompts of
its own (token ids), so what one test caches cannot be hit by another.
"""

from __future__ import annotations

import random

import openai
import pytest
from server_fixtures import ServerProcess, launch_server, make_server_checkpoint

pytestmark = pytest.mark.timeout(120)

MODEL = "pagoda-prefix"
BLOCK_SIZE = 16
PROMPT_LEN = 40  # 2 full blocks of 16 can be served; the third holds the last prompt token
HIT = 32
COMMON_ARGS = ("--num-kv-blocks", "32", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
               "--max-num-batched-tokens", "256", "--max-model-len", "512")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-prefix-cache")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=512)
    launched = [launch_server(model_dir, root, *COMMON_ARGS, served_model_name=MODEL),
                launch_server(model_dir, root, *COMMON_ARGS, "--no-enable-prefix-caching", served_model_name=MODEL)]
    try:
        for server in launched:
            server.wait_for_health(200)
            # The engine thread publishes its counters after each step, and every 0.5 s when idle; the
            # start-up warm-up ran outside that loop. One request makes later baselines exact.
            complete(server, [5, 6, 7])
            server.wait_until_idle()
        yield launched
    finally:
        for server in launched:
            server.stop()


@pytest.fixture(scope="module")
def server(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def uncached_server(servers) -> ServerProcess:
    return servers[1]


_prompt_seeds = iter(range(1000))


def new_prompt(length: int = PROMPT_LEN) -> list[int]:
    """Token ids no other test uses."""
    rng = random.Random(next(_prompt_seeds))
    return [rng.randrange(5, 512) for _ in range(length)]


def complete(server: ServerProcess, prompt: list[int], **extra) -> openai.types.Completion:
    with server.client() as client:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
                                         extra_body={"ignore_eos": True, **extra})


def cached_tokens(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def counters(server: ServerProcess) -> tuple[float, float]:
    metrics = server.metrics()
    return metrics.value("vllm:prefix_cache_queries_total"), metrics.value("vllm:prefix_cache_hits_total")


def wait_for_counters(server: ServerProcess, queries: float, hits: float) -> None:
    """The engine publishes its counters after the step that answered: poll, don't race."""
    server.wait_for_metrics(
        lambda m: (m.value("vllm:prefix_cache_queries_total"), m.value("vllm:prefix_cache_hits_total"))
        == (queries, hits),
        f"prefix cache counters at {queries} queries, {hits} hits",
    )


def test_repeated_prompt_is_served_from_the_cache_and_counted(server):
    server.wait_until_idle()
    queries, hits = counters(server)
    prompt = new_prompt()
    first, second = complete(server, prompt), complete(server, prompt)
    assert cached_tokens(first) == 0
    assert cached_tokens(second) == HIT
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == PROMPT_LEN
    wait_for_counters(server, queries + 2 * PROMPT_LEN, hits + HIT)
    metrics = server.metrics()
    assert metrics.families["vllm:prefix_cache_queries"] == "counter"
    assert metrics.families["vllm:prefix_cache_hits"] == "counter"


def test_streamed_usage_reports_cached_tokens(server):
    prompt = new_prompt()
    complete(server, prompt)
    with server.client() as client:
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ))
    assert chunks[-1].usage is not None and cached_tokens(chunks[-1]) == HIT


def test_reset_prefix_cache_forgets_everything_cached(server):
    prompt = new_prompt()
    complete(server, prompt)
    assert cached_tokens(complete(server, prompt)) == HIT
    server.wait_until_idle()
    response = server.post("/reset_prefix_cache")
    assert response.status_code == 200, response.text
    assert response.json()["reset_blocks"] >= 2
    assert cached_tokens(complete(server, prompt)) == 0, "the reset left a block cached"
    assert cached_tokens(complete(server, prompt)) == HIT, "caching works again after a reset"
    server.wait_until_idle()
    assert server.post("/reset_prefix_cache").json()["reset_blocks"] >= 2
    assert server.post("/reset_prefix_cache").json()["reset_blocks"] == 0


def test_cache_salt_separates_tenants(server):
    prompt = new_prompt()
    salts = ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b", None]
    served = [cached_tokens(complete(server, prompt, **({"cache_salt": s} if s else {}))) for s in salts]
    assert served == [0, 0, HIT, 0, HIT, HIT], "hits only within one salt (no salt is a tenant of its own)"


def chat(server: ServerProcess, messages: list[dict], **extra):
    with server.client() as client:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                              extra_body={"ignore_eos": True, **extra})


def tokenize_chat(server: ServerProcess, messages: list[dict]) -> list[int]:
    response = server.post("/tokenize", {"messages": messages, "add_generation_prompt": True})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_multi_turn_chat_hits_the_previous_turn(server):
    turn1 = [{"role": "system", "content": "You answer in one short sentence, always politely. " * 2},
             {"role": "user", "content": "What is a fox?"}]
    first = chat(server, turn1)
    assert cached_tokens(first) == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a badger?"}]
    second = chat(server, turn2)
    # Whole blocks of what the two renderings share, at least: all of turn 1's prompt, unless the re-rendered
    # history tokenizes its end differently; further into the answer as far as its re-tokenization matches
    # the generated ids.
    ids1, ids2 = tokenize_chat(server, turn1), tokenize_chat(server, turn2)
    assert len(ids1) == first.usage.prompt_tokens and len(ids2) == second.usage.prompt_tokens
    shared = next(i for i, (a, b) in enumerate(zip(ids1 + [-1], ids2)) if a != b)
    assert cached_tokens(second) >= shared // BLOCK_SIZE * BLOCK_SIZE > 0
    assert cached_tokens(second) % BLOCK_SIZE == 0 and cached_tokens(second) < len(ids2)
    assert cached_tokens(chat(server, turn2, cache_salt="someone-else")) == 0


def test_no_enable_prefix_caching_never_hits(uncached_server):
    uncached_server.wait_until_idle()
    queries, hits = counters(uncached_server)
    assert hits == 0
    prompt = new_prompt()
    responses = [complete(uncached_server, prompt) for _ in range(2)]
    assert [cached_tokens(r) for r in responses] == [0, 0]
    assert responses[0].choices[0].text == responses[1].choices[0].text
    wait_for_counters(uncached_server, queries + 2 * PROMPT_LEN, 0)


def test_start_up_warm_up_does_not_race_the_engine_thread(checkpoint, monkeypatch):
    """Found through the counters above (the warm-up's 4 prompt tokens show up in them): launcher.load_engine
    starts the AsyncEngine thread and then runs _warm_up(engine) on the loading thread. The engine thread
    wakes every 0.5 s, sees the warm-up request unfinished and calls engine.step() too: two threads
    stepping one engine, which is not thread-safe. Slow steps make the overlap certain here."""
    import threading
    import time

    from pagoda.engine.engine import LLMEngine
    from pagoda.entrypoints import build_engine_config
    from pagoda.server import launcher
    from pagoda.server.state import ServerState

    stepped_by: list[str] = []
    step = LLMEngine.step

    def slow_step(self):
        stepped_by.append(threading.current_thread().name)
        time.sleep(0.3)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)
    state = ServerState(model_name=MODEL)
    config = build_engine_config(str(checkpoint("llama")), num_kv_blocks=32, block_size=BLOCK_SIZE, max_model_len=256)
    launcher.load_engine(state, config, on_error=lambda: pytest.fail(state.load_error))
    try:
        assert len(set(stepped_by)) == 1, f"the engine was stepped from {sorted(set(stepped_by))} during warm-up"
    finally:
        state.engine.shutdown()
