"""The offloading connector at tensor parallel 2: each rank saves and loads its own share of every block (its KV
heads), so a rank moves half a block; a load is agreed across ranks (the smallest count any rank loaded), so a
block one rank lacks is computed by both.

Greedy output with offloading on equals offloading off at the same TP under eviction pressure, and the prompt
tokens computed drop by exactly what the tiers loaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from kv_offload_fixtures import RedisServer, prompts, redis_server_binary, run_turns, tier

from pagoda.engine.kv_connector.redis_store import KEY_PREFIX

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
POOL = {"num_kv_blocks": 24, "block_size": BLOCK_SIZE, "max_model_len": 96}  # two 40-token prompts evict
LOCAL = {"kv_offloading_size": 0.01}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path)
    server.start()
    yield server
    server.kill()


def returning_turns(seed: int) -> list[list[int]]:
    first, *others = prompts(seed, 4, 40)
    return [first, *others, first + [7, 8, 9, 10, 11]]


def test_at_tp2_a_returning_turn_loads_each_ranks_half_and_outputs_the_same(model_dir, make_llm):
    turns = returning_turns(40)
    with make_llm(model_dir, tensor_parallel_size=2, **POOL) as off:
        expected = run_turns(off, turns)
        off_stats = off.engine.stats()
    with make_llm(model_dir, tensor_parallel_size=2, **POOL, **LOCAL) as on:
        assert run_turns(on, turns) == expected
        on_stats = on.engine.stats()
        split_layout = on.engine.kv_connector.worker.local.layout
        local = tier(on, "CPU")
    with make_llm(model_dir, **POOL, **LOCAL) as whole:
        assert run_turns(whole, turns) == expected
        whole_layout = whole.engine.kv_connector.worker.layout
    loaded = on_stats.kv_connector.external_prefix_cache_hits
    assert loaded >= 36 and local.hit_tokens == loaded
    assert off_stats.prompt_tokens_computed - on_stats.prompt_tokens_computed == loaded
    assert on_stats.prefix_cache_hits == off_stats.prefix_cache_hits
    # rank 0's share: half of every block's bytes (its KV heads), never a gather of the whole block
    assert 2 * split_layout.payload_bytes == whole_layout.payload_bytes
    assert local.bytes_loaded == local.hit_blocks * split_layout.value_bytes


def test_at_tp2_a_block_one_rank_lacks_is_computed_by_both(model_dir, make_llm, redis_server):
    """Rank 1's share of a conversation is deleted from the shared store: rank 0 finds and loads its own, but the
    ranks agree on the smallest count, so the turn computes its whole prompt, with the same output."""
    conversation = prompts(41, 1, 40)[0]
    follow_up = conversation + [3, 4, 5, 6]
    shared = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "shared_store": redis_server.url, "store_timeout_ms": 500}}}
    with make_llm(model_dir, tensor_parallel_size=2, **POOL) as off:
        expected = run_turns(off, [conversation, follow_up])
    with make_llm(model_dir, tensor_parallel_size=2, **POOL, **shared) as writer:
        assert run_turns(writer, [conversation]) == expected[:1]
        namespace = writer.engine.kv_connector.scheduler.namespace
    client = redis.Redis.from_url(redis_server.url)
    keys = list(client.scan_iter(KEY_PREFIX + b"*"))
    rank0 = [key for key in keys if key.startswith(KEY_PREFIX + namespace)]
    assert len(rank0) == 11 and len(keys) == 22, "each rank stores its own share under its own keys"
    with make_llm(model_dir, tensor_parallel_size=2, **POOL, **shared) as reader:
        assert run_turns(reader, [follow_up]) == expected[1:]  # both ranks' shares there: loaded
        assert reader.engine.stats().kv_connector.external_prefix_cache_hits == 40
    client.delete(*[key for key in keys if key not in rank0])
    client.close()
    with make_llm(model_dir, tensor_parallel_size=2, **POOL, **shared) as reader:
        assert run_turns(reader, [follow_up]) == expected[1:]
        stats = reader.engine.stats()
    assert stats.kv_connector.failed_loads == 1 and stats.kv_connector.external_prefix_cache_hits == 0
    assert tier(reader, "SHARED").hit_blocks == 0, "rank 0's loaded blocks are not counted: rank 1 had none"
    assert stats.prompt_tokens_computed == len(follow_up)
