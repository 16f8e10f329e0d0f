"""The offloading connector's shared tier in a real redis-server: two engines ("replicas") sharing one store,
and a store killed mid-run and restarted on its port.

Outputs are compared token for token with an engine that offloads nothing, and every loaded token is accounted
for: the replica that reads the other's blocks computes exactly that many fewer prompt tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kv_offload_fixtures import RedisServer, prompts, redis_server_binary, run_turns, tier

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
POOL = {"num_kv_blocks": 64, "block_size": BLOCK_SIZE, "max_model_len": 128}
BACKOFF_S = 0.2


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


def offload(server: RedisServer, local_bytes: int = 0) -> dict:
    extra = {"shared_store": server.url, "store_timeout_ms": 200, "reconnect_backoff_s": BACKOFF_S,
             "max_reconnect_backoff_s": 2 * BACKOFF_S}
    if local_bytes:
        extra["cpu_bytes_to_use"] = local_bytes
    return {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}}


def test_a_replica_loads_what_another_replica_computed(model_dir, make_llm, redis_server):
    conversation = prompts(10, 1, 40)[0]
    follow_up = conversation + [3, 4, 5, 6]
    reference = make_llm(model_dir, **POOL)
    expected = run_turns(reference, [conversation, follow_up])
    first, second = make_llm(model_dir, **POOL, **offload(redis_server)), make_llm(model_dir, **POOL,
                                                                                  **offload(redis_server))
    assert run_turns(first, [conversation]) == expected[:1]
    assert tier(first, "SHARED").blocks_saved == 11  # 47 tokens computed: 40 of prompt, 7 of output
    assert run_turns(second, [follow_up]) == expected[1:]
    shared = tier(second, "SHARED")
    assert (shared.hit_blocks, shared.hit_tokens, shared.failures, shared.refused_blocks) == (10, 40, 0, 0)
    stats = second.engine.stats()
    assert stats.kv_connector.external_prefix_cache_hits == 40
    assert stats.prompt_tokens_computed == len(follow_up) - 40


def test_a_corrupt_shared_block_is_refused_and_computed_instead(model_dir, make_llm, redis_server):
    import redis

    conversation = prompts(11, 1, 40)[0]
    follow_up = conversation + [9, 9, 9]
    expected = run_turns(make_llm(model_dir, **POOL), [follow_up])
    run_turns(make_llm(model_dir, **POOL, **offload(redis_server)), [conversation])
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys(b"pagoda:kv:*"))
    assert len(keys) == 11
    for key in keys:  # flip the last byte of every stored block
        value = bytearray(client.get(key))
        value[-1] ^= 0x01
        client.set(key, bytes(value))
    reader = make_llm(model_dir, **POOL, **offload(redis_server))
    assert run_turns(reader, [follow_up]) == expected
    shared = tier(reader, "SHARED")
    assert (shared.refused_blocks, shared.hit_blocks) == (1, 0)
    assert reader.engine.stats().prompt_tokens_computed == len(follow_up)


def test_a_store_killed_mid_run_is_bypassed_and_used_again_once_it_is_back(model_dir, make_llm, redis_server):
    """Prefix caching off, so every turn asks the tiers: what each tier supplies is counted turn by turn."""
    no_prefix_cache = {**POOL, "enable_prefix_caching": False}
    a, b, c, d = prompts(12, 4, 40)
    turns = [a, a + [1], b, b + [2], c, c + [3], d, d + [4]]
    reference = make_llm(model_dir, **no_prefix_cache)
    expected = run_turns(reference, turns)
    writer = make_llm(model_dir, **no_prefix_cache, **offload(redis_server))
    replica = make_llm(model_dir, **no_prefix_cache, **offload(redis_server, local_bytes=1 << 22))

    # Up: what the writer computed, the replica loads from the shared tier.
    assert run_turns(writer, [a]) == expected[:1]
    assert run_turns(replica, [a + [1]]) == expected[1:2]
    assert tier(replica, "SHARED").hit_blocks == 10

    # Killed: no request fails; the replica's own blocks still come back from its local tier.
    redis_server.kill()
    started = time.monotonic()
    assert run_turns(replica, [b, b + [2]]) == expected[2:4]
    assert time.monotonic() - started < 30
    assert tier(replica, "SHARED").failures >= 1
    assert tier(replica, "SHARED").hit_blocks == 10
    assert tier(replica, "CPU").hit_blocks == 10  # b's blocks, which it saved to its local tier
    assert run_turns(writer, [c]) == expected[4:5]  # the writer's saves fail, and it answers all the same
    assert run_turns(replica, [c + [3]]) == expected[5:6]
    assert tier(replica, "SHARED").hit_blocks == 10  # c is in no tier the replica can reach

    # Back on its port (empty: no persistence): after the backoff, saves and hits on the shared tier resume.
    redis_server.start()
    time.sleep(3 * BACKOFF_S)
    assert run_turns(writer, [d]) == expected[6:7]
    assert tier(writer, "SHARED").blocks_saved == 22  # a's, and d's once back (11 each)
    assert run_turns(replica, [d + [4]]) == expected[7:8]
    assert tier(replica, "SHARED").hit_blocks == 20
    for engine in (writer, replica):
        assert engine.engine.stats().kv_connector.failed_loads == 0


def test_a_hung_store_costs_at_most_its_bounded_wait_and_the_tokens_are_computed(model_dir, make_llm, redis_server):
    """SIGSTOP: the store accepts connections and answers nothing, as an overloaded one does."""
    import signal

    conversation = prompts(13, 1, 40)[0]
    follow_up = conversation + [5, 5]
    expected = run_turns(make_llm(model_dir, **POOL), [follow_up])
    run_turns(make_llm(model_dir, **POOL, **offload(redis_server)), [conversation])
    reader = make_llm(model_dir, **POOL, **offload(redis_server))
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert run_turns(reader, [follow_up]) == expected
        elapsed = time.monotonic() - started
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    shared = tier(reader, "SHARED")
    assert shared.failures >= 1 and shared.hit_blocks == 0
    assert reader.engine.stats().prompt_tokens_computed == len(follow_up)
    # One timed-out call (200 ms), then the store is skipped: the turn is not held up by it.
    assert elapsed < 5.0
