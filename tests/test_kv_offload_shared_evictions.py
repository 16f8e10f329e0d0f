"""The shared tier's losses reach the router: blocks that a real redis-server evicts (maxmemory LRU), lets expire
(store_ttl_s) or loses (killed, back empty on its port) are published as BlockRemoved with the shared medium, and
the router's shared index, fed the engine's KV events through the router's own event stream, ends up holding
exactly the blocks the store holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from kv_offload_fixtures import RedisServer, prompts, redis_server_binary

from pagoda import SamplingParams
from pagoda.block_hash import wire_block_hash
from pagoda.engine.kv_connector.keys import block_hash_of
from pagoda.engine.kv_connector.redis_store import KEY_PREFIX
from pagoda.entrypoints import build_engine_config
from pagoda.kv_transfer_config import SHARED_MEDIUM
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.events import EventStream
from pagoda.wire.kv_events import all_blocks_cleared, block_removed, block_stored, encode_batch

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
POOL = {"num_kv_blocks": 64, "block_size": BLOCK_SIZE, "max_model_len": 128}
URL = "http://replica"


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


class RouterFeed:
    """A KVEventSink that hands each event to the router's event stream as the ZMQ publisher would: one encoded
    batch, its sequence number next. Called from the engine, save and eviction threads alike."""

    def __init__(self) -> None:
        self.router = Router([URL], RouterConfig(default_block_size=BLOCK_SIZE), event_endpoints={URL: "tcp://r:1"})
        self.stream = EventStream(self.router, self.router.replicas[0])
        self.removed_shared = 0
        self._sequence = 0
        self._lock = threading.Lock()

    def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size, medium="GPU") -> None:
        self._send(block_stored(block_hashes, parent_hash, token_ids, block_size, medium))

    def blocks_removed(self, block_hashes, medium="GPU") -> None:
        if medium == SHARED_MEDIUM:
            self.removed_shared += len(block_hashes)
        self._send(block_removed(block_hashes, medium))

    def all_blocks_cleared(self) -> None:
        self._send(all_blocks_cleared())

    def _send(self, event) -> None:
        with self._lock:
            self.stream.receive(self._sequence, encode_batch(time.time(), [event]))
            self._sequence += 1


def make_engine(model_dir, server: RedisServer, feed: RouterFeed, **extra):
    from conftest import register_engine

    from pagoda.engine.engine import LLMEngine

    config = build_engine_config(str(model_dir), **POOL, kv_transfer_config={
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"shared_store": server.url, "store_timeout_ms": 500,
                                      "reconnect_backoff_s": 0.1, "max_reconnect_backoff_s": 0.2, **extra}})
    engine = LLMEngine(config, kv_events=feed)
    register_engine(engine)
    return engine


def run(engine, prompt: list[int]) -> None:
    engine.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_connector.worker.wait_for_saves()


def stored_blocks(server: RedisServer) -> set[int]:
    """The router's keys of the blocks the store holds now."""
    client = redis.Redis.from_url(server.url)
    try:
        return {wire_block_hash(block_hash_of(key[len(KEY_PREFIX):])) for key in client.scan_iter(KEY_PREFIX + b"*")}
    finally:
        client.close()


def shared_index_equals_store(feed: RouterFeed, server: RedisServer, timeout_s: float = 10.0) -> set[int]:
    """Waits until the router's shared index holds exactly what the store holds; returns it."""
    index = feed.router.shared_index
    deadline = time.monotonic() + timeout_s
    while True:
        held = stored_blocks(server)
        if len(index) == len(held) and all(key in index for key in held):
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"the shared index holds {len(index)} blocks, the store {len(held)}")
        time.sleep(0.05)


def wait_following(engine) -> None:
    evictions = engine.kv_connector.worker.tiers[0].evictions
    deadline = time.monotonic() + 10
    while not evictions.notifications and time.monotonic() < deadline:
        time.sleep(0.02)
    assert evictions.notifications, "keyspace notifications were not turned on"


def test_blocks_the_store_evicts_leave_the_routers_shared_index(model_dir, redis_server):
    feed = RouterFeed()
    engine = make_engine(model_dir, redis_server, feed)
    wait_following(engine)
    first, *others = prompts(30, 4, 40)
    run(engine, first)
    assert len(shared_index_equals_store(feed, redis_server)) == 10  # 41 tokens computed: 10 full blocks
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    # room for about four more blocks: the next prompts' blocks evict the oldest
    room = 4 * engine.kv_connector.worker.layout.value_bytes
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] + room))
    client.close()
    for prompt in others:
        run(engine, prompt)
    held = shared_index_equals_store(feed, redis_server)
    assert feed.removed_shared > 0, "the store evicted nothing: the test proves nothing"
    assert 0 < len(held) < 40
    assert engine.stats().kv_connector.tiers[0].evicted_blocks == feed.removed_shared
    engine.shutdown()


def test_blocks_that_expire_leave_the_index(model_dir, redis_server):
    feed = RouterFeed()
    engine = make_engine(model_dir, redis_server, feed, store_ttl_s=0.5)
    wait_following(engine)
    run(engine, prompts(31, 1, 40)[0])
    deadline = time.monotonic() + 10
    while stored_blocks(redis_server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shared_index_equals_store(feed, redis_server) == set()
    assert feed.removed_shared == 10
    engine.shutdown()


def test_a_store_back_empty_after_a_crash_empties_the_index_and_is_followed_again(model_dir, redis_server):
    feed = RouterFeed()
    engine = make_engine(model_dir, redis_server, feed)
    wait_following(engine)
    first, second = prompts(32, 2, 40)
    run(engine, first)
    assert len(shared_index_equals_store(feed, redis_server)) == 10
    redis_server.kill()
    redis_server.start()  # persistence off: back empty, its notification settings lost with it
    assert shared_index_equals_store(feed, redis_server) == set()
    assert feed.removed_shared == 10
    store = engine.kv_connector.worker.tiers[0]
    store.contains([b"probe"])  # its pooled connection died with the server: this call finds out
    time.sleep(0.3)  # the store's backoff
    run(engine, second)
    assert len(shared_index_equals_store(feed, redis_server)) == 10
    client = redis.Redis.from_url(redis_server.url)
    client.delete(*client.keys(KEY_PREFIX + b"*"))  # not an eviction: only reconciliation sees it
    client.close()
    engine.kv_connector.worker.tiers[0].evictions.reconcile_soon()
    assert shared_index_equals_store(feed, redis_server) == set()
    engine.shutdown()
