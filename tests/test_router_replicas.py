"""`pagoda route` over three real `pagoda serve` replicas on loopback (a tiny model, one thread each).

A multi-turn chat workload runs once through a round_robin router and once through a cache_aware one, each
with conversations of its own: cache_aware must get at least twice round_robin's prefix-cache hit rate (as
the replicas' own vllm:prefix_cache_* counters count it) with no replica serving more than 1.5x its fair
share. Then one replica is killed mid-run: no request that had not started streaming may be lost.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import server_fixtures
from server_fixtures import (
    Metrics,
    ServerProcess,
    launch_server,
    make_server_checkpoint,
    wait_until,
)

from pagoda.router.tokens import TokenizingReader
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(300)

MODEL = "pagoda-router-test"
BLOCK_SIZE = 8  # not the router's default (16): it must read the replicas' vllm:cache_config_info
# A replica holds its share of the conversations (what cache_aware sends it), not all of them (what round robin
# does): as a real fleet, where the point of routing is that the caches together hold more than one can.
NUM_KV_BLOCKS = 320
REPLICA_ARGS = ("--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "16",
                "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--no-use-kernels")
CONVERSATIONS = 7  # not a multiple of 3: round robin cannot land a conversation on one replica by accident
TURNS = 3
ARRIVAL_GAP_S = 0.2  # wide enough that the router sees a round's turns in the order sent, on a loaded 2-core host
WORDS = ["river", "stone", "cloud", "forest", "lantern", "harbor", "copper", "meadow", "violet", "engine", "orbit",
         "canyon", "willow", "signal", "marble", "thunder", "garden", "silver", "pepper", "falcon"]


def launch_router(replicas: list[ServerProcess], model_dir: Path, log_dir: Path, policy: str) -> ServerProcess:
    router = server_fixtures.launch_router([r.url for r in replicas], log_dir, "--tokenizer", str(model_dir),
                                           "--policy", policy, "--retry-backoff", "0.01", served_model_name=MODEL)
    try:
        router.wait_for_health(200)
        router.wait_for_metrics(  # the block size comes from the replicas' first poll
            lambda m: m.labels_of("pagoda_router_replica_block_size") and all(
                v == BLOCK_SIZE for (n, _), v in m.samples.items() if n == "pagoda_router_replica_block_size"),
            "the router to read the replicas' block size")
    except BaseException:
        router.stop()
        raise
    return router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("router-replicas")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=1024)
    replicas = [launch_server(model_dir, root, *REPLICA_ARGS, served_model_name=MODEL) for _ in range(3)]
    routers: dict[str, ServerProcess] = {}
    try:
        for replica in replicas:
            replica.wait_for_health(200)
        for policy in ("round_robin", "cache_aware"):
            routers[policy] = launch_router(replicas, model_dir, root, policy)
        yield replicas, routers, model_dir
    finally:
        for process in [*routers.values(), *replicas]:
            process.stop()


def prefix_counters(replicas: list[ServerProcess]) -> list[tuple[float, float]]:
    """(queries, hits) per replica, once every replica is idle (counters are published after each step)."""
    counters = []
    for replica in replicas:
        metrics = replica.wait_until_idle()
        counters.append((metrics.value("vllm:prefix_cache_queries_total"),
                         metrics.value("vllm:prefix_cache_hits_total")))
    return counters


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def chat_workload(router: ServerProcess, seed: int) -> None:
    """CONVERSATIONS conversations, TURNS turns each, in lockstep rounds (a round's turns concurrently)."""
    rng = random.Random(seed)
    # No system prompt: a prefix every conversation shares would be a hit under any policy.
    histories = [[{"role": "user", "content": sentence(rng, 30)}] for _ in range(CONVERSATIONS)]

    def turn(history: list[dict]) -> str:
        with router.client() as client:
            response = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16,
                                                      temperature=0.0)
        return response.choices[0].message.content or ""

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        for turn_index in range(TURNS):
            order = rng.sample(range(CONVERSATIONS), CONVERSATIONS)  # arrivals in a new order every round
            futures = []
            for index in order:  # staggered, so the router sees them in this order (round robin's turns)
                futures.append(pool.submit(turn, histories[index]))
                time.sleep(ARRIVAL_GAP_S)
            replies = {index: future.result() for index, future in zip(order, futures)}
            for index, history in enumerate(histories):
                history.append({"role": "assistant", "content": replies[index]})
                if turn_index < TURNS - 1:
                    history.append({"role": "user", "content": sentence(rng, 20)})


def run_phase(replicas: list[ServerProcess], router: ServerProcess, seed: int) -> tuple[float, list[float]]:
    """The workload's hit rate over all replicas and the requests each replica served."""
    before = prefix_counters(replicas)
    served_before = [r.metrics().value("vllm:request_success_total") for r in replicas]
    chat_workload(router, seed)
    after = prefix_counters(replicas)
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    served = [r.metrics().value("vllm:request_success_total") - s for r, s in zip(replicas, served_before)]
    return hits / queries, served


def test_cache_aware_doubles_round_robins_hit_rate_within_fair_shares(fleet):
    replicas, routers, _ = fleet
    rates, shares = {}, {}
    for seed, policy in enumerate(("round_robin", "cache_aware")):
        rates[policy], served = run_phase(replicas, routers[policy], seed)
        assert sum(served) == CONVERSATIONS * TURNS, served
        shares[policy] = max(served) / (sum(served) / len(replicas))
    print(f"prefix hit rate {rates}; max share of fair {shares}")
    assert rates["cache_aware"] >= 2 * rates["round_robin"], rates
    assert shares["cache_aware"] <= 1.5, shares
    metrics = routers["cache_aware"].metrics()
    expected = metrics.value("pagoda_router_expected_hit_tokens_total")
    assert expected > 0, "the router's index predicted hits"


def test_every_replica_exports_its_cache_config_as_vllm_does(fleet):
    replicas, _, _ = fleet
    labels = replicas[0].metrics().labels_of("vllm:cache_config_info")
    assert len(labels) == 1
    assert labels[0]["block_size"] == str(BLOCK_SIZE) and labels[0]["num_gpu_blocks"] == str(NUM_KV_BLOCKS)
    assert labels[0]["enable_prefix_caching"] == "True"


def test_killing_a_replica_mid_run_loses_no_request_that_had_not_started_streaming(fleet):
    replicas, routers, _ = fleet
    router, victim = routers["cache_aware"], replicas[2]
    rng = random.Random(99)

    def whole(prompt: list[int]) -> int:
        with router.client() as client:
            response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0.0,
                                                 extra_body={"ignore_eos": True})
        return response.usage.completion_tokens

    def streamed(prompt: list[int]) -> tuple[int, str | None]:
        """(chunks received, the error that ended the stream early or None)."""
        received = 0
        try:
            with router.client() as client:
                for _chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0.0,
                                                        stream=True, extra_body={"ignore_eos": True}):
                    received += 1
        except openai.APIError as error:
            return received, str(error)
        return received, None

    prompts = [[rng.randrange(5, 500) for _ in range(64)] for _ in range(18)]
    with ThreadPoolExecutor(18) as pool:
        wholes = [pool.submit(whole, p) for p in prompts[:12]]
        streams = [pool.submit(streamed, p) for p in prompts[12:]]
        wait_until(lambda: _active_on(router, victim) >= 2, 60, "requests in flight on the victim")
        victim.process.send_signal(signal.SIGKILL)
        results = [w.result() for w in wholes]
        stream_results = [s.result() for s in streams]
    assert results == [48] * 12, "every non-streamed request was answered in full"
    for received, error in stream_results:
        assert error is None or received > 0, f"a stream failed before its first byte: {error}"
    with router.client() as client:  # and afterwards, the fleet of two serves
        assert client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens == 2
    metrics = router.metrics()
    assert metrics.value("pagoda_router_retries_total", replica=victim.url) >= 1, "the victim's requests moved"
    wait_until(lambda: router.metrics().value("pagoda_router_replica_up", replica=victim.url) == 0, 10,
               "the router to see the victim down")


def _active_on(router: ServerProcess, replica: ServerProcess) -> float:
    metrics: Metrics = router.metrics()
    return metrics.value("pagoda_router_active_requests", replica=replica.url)


def test_the_router_reports_time_to_first_token_under_each_policy(fleet):
    """Not asserted (a tiny model's prefill is too cheap for its TTFT to show hits): printed for the record."""
    _, routers, _ = fleet
    for policy, router in routers.items():
        started = time.monotonic()
        with router.client() as client:
            for _chunk in client.completions.create(model=MODEL, prompt=[5] * 32, max_tokens=1, stream=True):
                break
        print(policy, f"ttft {time.monotonic() - started:.3f} s")


def test_a_client_that_leaves_mid_stream_frees_its_load_and_aborts_its_request(fleet):
    replicas, routers, _ = fleet
    router = routers["cache_aware"]

    alive = [r for r in replicas if r.process.poll() is None]  # one may have been killed above

    def aborted() -> float:
        return sum(r.metrics().value("vllm:request_success_total", finished_reason="abort") for r in alive)

    before = aborted()
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 900, "stream": True, "ignore_eos": True}
    with router.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first token arrived; then the client goes away
    wait_until(lambda: aborted() > before, 30, "the replica to abort the request")
    wait_until(lambda: router.metrics().value("pagoda_router_active_requests") == 0, 10, "the router's load to clear")


def test_the_router_tokenizes_chat_exactly_as_a_replica(fleet):
    """The same token ids as the replica's own /tokenize: the chat template rendered by the same function."""
    replicas, _, model_dir = fleet
    reader = TokenizingReader(TokenizerPool(load_tokenizer(model_dir), size=1))
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "river stone"},
                {"role": "assistant", "content": "cloud"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    routed = asyncio.run(reader.chat({"model": MODEL, "messages": messages, "cache_salt": "tenant"}))
    expected = replicas[0].post("/tokenize", {"model": MODEL, "messages": messages}).json()["tokens"]
    assert list(routed.token_ids) == expected and routed.cache_salt == "tenant"
    text = asyncio.run(reader.completion({"model": MODEL, "prompt": "river stone"}))
    expected = replicas[0].post("/tokenize", {"model": MODEL, "prompt": "river stone"}).json()["tokens"]
    assert list(text.token_ids) == expected
    unreadable = asyncio.run(reader.chat({"model": MODEL, "messages": "not a list"}))
    assert unreadable.token_ids is None, "routed by load; the replica answers the 400"


def test_a_continued_response_reaches_the_replica_that_stored_it(fleet):
    """Round robin would send each turn to another replica, which does not hold the conversation (a 404): the
    router sends a previous_response_id to the replica that answered it, streamed or not."""
    replicas, routers, _ = fleet
    router = routers["round_robin"]
    with router.client() as client:
        response = client.responses.create(model=MODEL, input="river stone", max_output_tokens=4, temperature=0.0)
        for turn in range(4):
            if turn % 2:
                events = list(client.responses.create(model=MODEL, input="cloud", previous_response_id=response.id,
                                                      max_output_tokens=4, temperature=0.0, stream=True))
                response = events[-1].response
            else:
                response = client.responses.create(model=MODEL, input="cloud", previous_response_id=response.id,
                                                   max_output_tokens=4, temperature=0.0)
            assert response.previous_response_id and response.status in ("completed", "incomplete")
        assert client.responses.retrieve(response.id).output_text == response.output_text
    alive = [r for r in replicas if r.process.poll() is None]
    owners = [r for r in alive if r.get(f"/v1/responses/{response.id}").status_code == 200]
    assert len(owners) == 1
