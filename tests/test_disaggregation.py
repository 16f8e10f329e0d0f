"""Prefill/decode disaggregation through real HTTP: a prefill replica (TcpConnector, kv_producer), a decode replica
(kv_consumer, with n-gram speculation and a pool small enough to preempt), `pagoda route --pd-disaggregation` in
front, and a plain replica of the same checkpoint as the reference. Greedy output through the split equals the
plain replica's, token for token, under chunked prefill (the prefill replica's batch is smaller than the prompts),
prefix caching, preemption and speculation; the decode replica computes at most one block of each transferred
prompt, and the bytes that cross the wire are calc's KV bytes for the blocks moved, so a recompute cannot pass
for a transfer. A pull that breaks halfway, or finds its blocks gone, falls back to computing and still
matches; a dead prefill replica is routed around; no block stays held on either side.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_fixtures import ServerProcess, free_port, launch_router, launch_server, make_server_checkpoint

from pagoda.calc import cli as calc_cli

pytestmark = pytest.mark.timeout(300)

MODEL = "pagoda-pd"
BLOCK_SIZE = 16
COMMON = ("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "8",
          "--max-num-batched-tokens", "48", "--max-model-len", "512")
PRODUCER = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer",
                       "kv_connector_extra_config": {"hold_timeout_s": 10.0}})
CONSUMER = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_buffer_size": 50_000_000,
                       "kv_connector_extra_config": {"pull_timeout_s": 2.0}})
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=512)
    reference = launch_server(model_dir, root, *COMMON, "--num-kv-blocks", "128", served_model_name=MODEL)
    prefill = launch_server(model_dir, root, *COMMON, "--num-kv-blocks", "128", "--kv-transfer-config", PRODUCER,
                            served_model_name=MODEL)
    # 20 blocks: four requests of ~100 prompt tokens cannot all run at once, so the decode replica preempts.
    decode = launch_server(model_dir, root, *COMMON, "--num-kv-blocks", "20", "--kv-transfer-config", CONSUMER,
                           "--speculative-config", NGRAM, served_model_name=MODEL)
    servers = [reference, prefill, decode]
    try:
        for server in servers:
            server.wait_for_health(200)
        router = launch_router([], root, "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                               served_model_name=MODEL)
        servers.append(router)
        router.wait_for_health(200)
        config = json.loads((model_dir / "config.json").read_text())
        yield {"reference": reference, "prefill": prefill, "decode": decode, "router": router, "root": root,
               "config": config, "model_dir": model_dir}
    finally:
        for server in servers:
            server.stop()


_seeds = iter(range(10_000))


def new_prompt(length: int) -> list[int]:
    """Token ids no other request used (so no prefix cache hit is shared by accident)."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(5, 500) for _ in range(length)]


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 12, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            **extra}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def tokens(server: ServerProcess, prompt: list[int], **extra) -> str:
    return [choice["text"] for choice in complete(server, prompt, **extra)["choices"]]


def kv_counters(server: ServerProcess) -> tuple[float, float, float]:
    """(prompt tokens computed, bytes pulled over TCP, pulls that failed) on a decode replica."""
    metrics = server.metrics()
    return (metrics.value("pagoda:prompt_tokens_computed_total"),
            metrics.value("vllm:kv_offload_total_bytes_total", transfer_type="TCP_to_GPU"),
            metrics.value("pagoda:kv_offload_failures_total", medium="TCP"))


def test_greedy_output_through_the_split_equals_one_engine_under_load(fleet):
    # Repeating prompts give n-gram speculation drafts to propose.
    prompts = [new_prompt(length) for length in (100, 70, 37)] + [new_prompt(length) * 10 for length in (9, 11, 6)]
    router, reference, decode = fleet["router"], fleet["reference"], fleet["decode"]
    preemptions = decode.metrics().value("vllm:num_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        split = list(pool.map(lambda p: tokens(router, p, max_tokens=40), prompts))
    for prompt, got in zip(prompts, split):
        assert got == tokens(reference, prompt, max_tokens=40)
    assert decode.metrics().value("vllm:num_preemptions_total") > preemptions, "the decode replica never preempted"
    assert decode.metrics().value("vllm:spec_decode_num_draft_tokens_total") > 0, "no speculation on the decode side"


def calc_handoff(model_dir, prompt_len: int, decode_prefix_len: int = 0) -> dict:
    """`pagoda calc --disagg`'s figures for this checkpoint, as its JSON prints them."""
    import contextlib
    import io

    argv = ["--model", str(model_dir), "--dtype", "fp32", "--prompt-len", str(prompt_len), "--block-size",
            str(BLOCK_SIZE), "--prefix-len", str(decode_prefix_len), "--disagg", "--json"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert calc_cli.main(argv) == 0
    return json.loads(printed.getvalue())["disagg"]


def test_decode_computes_at_most_a_block_and_the_bytes_moved_are_calcs(fleet):
    router, decode = fleet["router"], fleet["decode"]
    for length in (33, 48, 80, 97):
        prompt = new_prompt(length)
        computed, moved, _ = kv_counters(decode)
        assert tokens(router, prompt) == tokens(fleet["reference"], prompt)
        computed_now, moved_now, _ = kv_counters(decode)
        predicted = calc_handoff(fleet["model_dir"], length)
        assert computed_now - computed == length - predicted["handoff_tokens"] <= BLOCK_SIZE
        assert moved_now - moved == predicted["handoff_bytes"] > 0


def test_a_prefix_the_decode_replica_caches_is_not_pulled_again(fleet):
    router, decode, reference = fleet["router"], fleet["decode"], fleet["reference"]
    shared = new_prompt(4 * BLOCK_SIZE)
    first = shared + new_prompt(20)  # through the split: the decode replica caches the shared blocks
    assert tokens(router, first) == tokens(reference, first)
    for suffix in (30, 3):
        prompt = shared + new_prompt(suffix)
        computed, moved, failures = kv_counters(decode)
        assert tokens(router, prompt) == tokens(reference, prompt)
        computed_now, moved_now, failures_now = kv_counters(decode)
        predicted = calc_handoff(fleet["model_dir"], len(prompt), decode_prefix_len=len(shared))
        whole = calc_handoff(fleet["model_dir"], len(prompt))
        # Only the blocks after the cached prefix crossed the wire, and the decode replica still computed only the
        # last prompt token's block: the prefix came from its own cache, the rest from the prefill replica.
        assert moved_now - moved == predicted["handoff_bytes"] < whole["handoff_bytes"]
        assert computed_now - computed == len(prompt) - whole["handoff_tokens"] <= BLOCK_SIZE
        assert failures_now == failures
    # With nothing left to pull the decode replica still tells the producer, which releases the blocks at once.
    fleet["prefill"].wait_until_idle(timeout=5)


def test_prefix_hits_streaming_n_stop_strings_and_structured_output_as_on_one_replica(fleet):
    router, reference = fleet["router"], fleet["reference"]
    shared = new_prompt(64)
    for suffix in ([], new_prompt(20)):  # the second prefill hits the first's blocks in the producer's cache
        prompt = shared + suffix
        assert tokens(router, prompt) == tokens(reference, prompt)
    hit = complete(fleet["prefill"], shared + new_prompt(5), max_tokens=1)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64 - BLOCK_SIZE
    prompt = new_prompt(70)
    with router.client() as client:
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    assert [streamed] == tokens(reference, prompt)
    assert tokens(router, prompt, n=2) == tokens(reference, prompt, n=2)
    stop = tokens(reference, prompt)[0][3:6]
    assert tokens(router, prompt, stop=[stop]) == tokens(reference, prompt, stop=[stop])
    choice = {"structured_outputs": {"choice": ["red", "green", "blue"]}}
    assert tokens(router, prompt, **choice) == tokens(reference, prompt, **choice)


def test_a_broken_or_refused_pull_falls_back_to_computing(fleet):
    decode, reference, prefill = fleet["decode"], fleet["reference"], fleet["prefill"]
    prompt = new_prompt(80)
    wanted = tokens(reference, prompt)
    held = complete(prefill, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    transfer = held["kv_transfer_params"]
    assert transfer["do_remote_prefill"] and len(transfer["remote_block_ids"]) == (80 - 1) // BLOCK_SIZE
    _, _, failures = kv_counters(decode)
    # A producer that dies mid-transfer: the header, then a few bytes, then the connection closes.
    port, served = _dying_producer()
    assert tokens(decode, prompt, kv_transfer_params={**transfer, "remote_port": port}) == wanted
    served.join(10)
    # The real producer's blocks, pulled twice: the second pull is refused (they went back to its pool).
    assert tokens(decode, prompt, kv_transfer_params=transfer) == wanted
    assert tokens(decode, prompt, kv_transfer_params=transfer) == wanted
    # Nobody listening at all.
    assert tokens(decode, prompt, kv_transfer_params={**transfer, "remote_port": free_port()}) == wanted
    assert kv_counters(decode)[2] - failures == 3


def _dying_producer() -> tuple[int, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            connection, _ = listener.accept()
            with connection:
                connection.makefile("rb").readline()
                connection.sendall(json.dumps({"ok": True, "num_blocks": 4, "value_bytes": 100_000}).encode() + b"\n")
                connection.sendall(b"\0" * 1000)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def test_a_dead_prefill_replica_is_routed_around(fleet):
    root, prefill, decode, reference = fleet["root"], fleet["prefill"], fleet["decode"], fleet["reference"]
    dead = f"http://127.0.0.1:{free_port()}"
    routers = [launch_router([], root, "--pd-disaggregation", "--prefill", dead, "--prefill", prefill.url,
                             "--decode", decode.url, served_model_name=MODEL),
               launch_router([], root, "--pd-disaggregation", "--prefill", dead, "--decode", decode.url,
                             served_model_name=MODEL)]
    try:
        for router in routers:
            router.wait_for_health(200)
            for _ in range(3):
                prompt = new_prompt(50)
                assert tokens(router, prompt) == tokens(reference, prompt)
    finally:
        for router in routers:
            router.stop()


def test_bad_kv_transfer_params_are_a_400_naming_the_field(fleet):
    for body in ({"do_remote_prefill": True}, {"remote_port": "x"}, {"do_remote_decode": 1}, {"surprise": 1}):
        response = fleet["decode"].post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                            "kv_transfer_params": body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "kv_transfer_params"
    # The reference replica has no TcpConnector: neither role is available there.
    response = fleet["reference"].post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                           "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "kv_transfer_params"


def test_no_block_stays_held_on_either_side(fleet):
    prompt = new_prompt(60)
    complete(fleet["prefill"], prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    for name in ("prefill", "decode", "reference"):
        fleet[name].wait_until_idle(timeout=90)  # the one never pulled goes after the hold timeout
