"""KV events: what the KV manager reports, current vLLM's wire format field by field (and decoded with vLLM's own
msgspec struct definitions; the router also reads v0.9.0's positional form), the ZMQ transport (three frames,
sequence numbers, replay), the router's index following a replica's events (by medium: its pool, its offload
tier, the shared store), and one real server whose published hashes are the ones the router computes."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import msgspec
import pytest
import server_fixtures
import zmq
from server_fixtures import ServerProcess, free_port, launch_server, make_server_checkpoint, wait_until

from pagoda.block_hash import hash_block_chain, wire_block_hash
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.events import EventStream
from pagoda.router.policies import RoutedPrompt
from pagoda.sampling import SamplingParams
from pagoda.server.kv_events import ZmqKVEventPublisher
from pagoda.wire.kv_events import (
    END_OF_REPLAY,
    KVEventsConfig,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
)

pytestmark = pytest.mark.timeout(120)

BLOCK_SIZE = 4


# --------------------------------------------------------------------------------------------------
# Current vLLM's definitions (vllm/distributed/kv_events.py), as a consumer built for vLLM decodes them
# --------------------------------------------------------------------------------------------------

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# --------------------------------------------------------------------------------------------------
# What the KV manager reports
# --------------------------------------------------------------------------------------------------


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size, medium="GPU") -> None:
        assert medium == "GPU", "the KV manager reports its own pool's blocks"
        self.events.append(("stored", list(block_hashes), parent_hash, list(token_ids), block_size))

    def blocks_removed(self, block_hashes, medium="GPU") -> None:
        assert medium == "GPU"
        self.events.append(("removed", list(block_hashes)))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared",))


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=4), seed=0,
                   max_model_len=256)


def prefill(manager: KVCacheManager, req: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit_tokens, hits) is not None
    req.num_computed_tokens = req.num_tokens
    manager.cache_full_blocks(req)


def finish(manager: KVCacheManager, req: Request) -> None:
    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    manager.free(req)


def test_the_kv_manager_reports_stored_evicted_and_cleared_blocks():
    sink = RecordingSink()
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, events=sink)  # a fills it
    first = list(range(10, 24))  # 3 full blocks + 2 tokens
    chain = hash_block_chain(first, BLOCK_SIZE)
    prefill(manager, a := request("a", first))
    assert sink.events == [("stored", chain, None, first[:12], BLOCK_SIZE)]
    finish(manager, a)

    sink.events.clear()
    second = first[:8] + list(range(50, 58))  # shares 2 blocks, then 2 new ones
    prefill(manager, b := request("b", second))
    second_chain = hash_block_chain(second, BLOCK_SIZE)
    assert second_chain[:2] == chain[:2]
    # b's 2 new blocks come off the LRU: a's partial last block (nothing cached), then its 3rd block.
    assert sink.events[0] == ("removed", [chain[2]])
    assert sink.events[1:] == [("stored", second_chain[2:], second_chain[1], second[8:], BLOCK_SIZE)]

    sink.events.clear()
    manager.reset_prefix_cache()  # b still holds its blocks: they stay cached, only the others go
    assert sink.events == [], "no free block was cached: nothing to report"
    finish(manager, b)
    manager.reset_prefix_cache()
    assert sink.events[-1] == ("cleared",)
    manager.check_invariants()


# --------------------------------------------------------------------------------------------------
# The wire format, field by field
# --------------------------------------------------------------------------------------------------


def test_a_batch_is_vllms_tagged_msgpack_field_by_field():
    hashes = hash_block_chain(list(range(8)), BLOCK_SIZE)
    payload = encode_batch(1700000000.5, [
        block_stored(hashes, None, list(range(8)), BLOCK_SIZE),
        block_stored(hashes[1:], hashes[0], list(range(4, 8)), BLOCK_SIZE, medium="CPU"),
        block_removed(hashes[:1]),
        block_removed(hashes[1:], medium="SHARED"),
        all_blocks_cleared(),
    ])
    batch = msgpack.unpackb(payload)
    assert list(batch) == ["ts", "events"] and batch["ts"] == 1700000000.5
    events = batch["events"]
    wire = [wire_block_hash(h) for h in hashes]
    assert wire[0] == int.from_bytes(hashes[0][:8], "big") and all(0 <= w < 2**64 for w in wire)
    stored_fields = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                     "lora_name"]
    assert list(events[0]) == stored_fields, "vLLM's field order"
    assert list(events[0].values()) == ["BlockStored", wire, None, list(range(8)), BLOCK_SIZE, None, "GPU", None]
    assert list(events[1].values()) == ["BlockStored", wire[1:], wire[0], list(range(4, 8)), BLOCK_SIZE, None, "CPU",
                                        None]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": wire[:1], "medium": "GPU"}
    assert list(events[3].values()) == ["BlockRemoved", wire[1:], "SHARED"]
    assert events[4] == {"type": "AllBlocksCleared"}

    decoded = VLLM_DECODER.decode(payload)  # and vLLM's own types read it
    assert decoded.ts == 1700000000.5 and decoded.data_parallel_rank is None
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.lora_id,
            stored.medium, stored.lora_name) == (wire, None, list(range(8)), BLOCK_SIZE, None, "GPU", None)
    assert decoded.events[1].parent_block_hash == wire[0] and decoded.events[1].medium == "CPU"
    assert isinstance(decoded.events[2], BlockRemoved) and decoded.events[2].block_hashes == wire[:1]
    assert decoded.events[3].medium == "SHARED"
    assert isinstance(decoded.events[4], AllBlocksCleared)


def test_the_config_is_vllms_and_refuses_unknown_fields():
    config = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "zmq"})
    assert config.publishes and config.endpoint == "tcp://*:5557" and config.topic == ""
    assert not KVEventsConfig.from_dict({"publisher": "zmq"}).publishes, "enable_kv_cache_events is off by default"
    with pytest.raises(ValueError, match="endpont"):
        KVEventsConfig.from_dict({"endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(publisher="kafka")


# --------------------------------------------------------------------------------------------------
# The ZMQ transport
# --------------------------------------------------------------------------------------------------


def receive(socket: zmq.Socket, timeout_s: float = 5.0) -> list[bytes] | None:
    return socket.recv_multipart() if socket.poll(int(timeout_s * 1000)) else None


def test_batches_go_out_as_three_frames_with_sequence_numbers_and_can_be_replayed():
    port, replay_port = free_port(), free_port()
    publisher = ZmqKVEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}", topic="kv"))
    context = zmq.Context.instance()
    subscriber = context.socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        # PUB drops what it sends before the subscription reaches it: probe until one arrives.
        deadline = time.monotonic() + 10
        while (frames := receive(subscriber, 0.05)) is None:
            assert time.monotonic() < deadline, "no message reached the subscriber"
            publisher.all_blocks_cleared()
        while (more := receive(subscriber, 0.2)) is not None:  # probes still in flight
            frames = more
        last_probe = int.from_bytes(frames[1], "big")

        hashes = hash_block_chain(list(range(8)), BLOCK_SIZE)
        publisher.blocks_stored(hashes, None, list(range(8)), BLOCK_SIZE)
        topic, sequence, payload = receive(subscriber)
        assert topic == b"kv" and len(sequence) == 8 and int.from_bytes(sequence, "big") == last_probe + 1
        assert VLLM_DECODER.decode(payload).events[0].block_hashes == [wire_block_hash(h) for h in hashes]

        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (last_probe + 1).to_bytes(8, "big")])
        assert receive(replay)[1:] == [sequence, payload]
        assert receive(replay)[1:] == [END_OF_REPLAY, b""]
        replay.close(linger=0)
    finally:
        subscriber.close(linger=0)
        publisher.shutdown()


def test_a_taken_endpoint_fails_the_start_naming_it():
    port = free_port()
    first = ZmqKVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                               endpoint=f"tcp://*:{port}"))
    try:
        with pytest.raises(ValueError, match=str(port)):
            ZmqKVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                               endpoint=f"tcp://*:{port}"))
    finally:
        first.shutdown()


# --------------------------------------------------------------------------------------------------
# The router's index follows the events
# --------------------------------------------------------------------------------------------------


def test_the_router_index_follows_a_replicas_events():
    router = Router(["http://a", "http://b"], RouterConfig(default_block_size=BLOCK_SIZE),
                    event_endpoints={"http://a": "tcp://a:5557"})
    for each in router.replicas:
        router.set_health(each, True)
    replica = router.replicas[0]
    assert replica.learns_from_events and not router.replicas[1].learns_from_events
    tokens = list(range(100, 113))  # 3 full blocks
    prompt = RoutedPrompt(tokens)
    hashes = hash_block_chain(tokens, BLOCK_SIZE)
    stream = EventStream(router, replica)

    def matched() -> int:
        return replica.index.match(prompt.cacheable(BLOCK_SIZE), router.clock())

    lease = router.begin(router.choose(prompt, exclude=[router.replicas[1]]))
    lease.finish()
    assert matched() == 0, "routing alone teaches nothing about a replica that publishes events"
    stream.receive(0, encode_batch(0.0, [block_stored(hashes, None, tokens[:12], BLOCK_SIZE)]))
    assert matched() == 3
    assert router.choose(prompt).replica is replica, "cache_aware follows what the events say"
    stream.receive(1, encode_batch(0.0, [block_removed(hashes[1:2])]))
    assert matched() == 1
    stream.receive(5, encode_batch(0.0, [all_blocks_cleared()]))
    assert matched() == 0
    assert router.metrics.event_gaps.labels("http://a")._value.get() == 3
    stream.receive(6, encode_batch(0.0, [block_stored(hashes, None, tokens[:12], BLOCK_SIZE)]))
    stream.receive(0, encode_batch(0.0, []))  # the sequence started again: the replica restarted
    assert matched() == 0
    stream.receive(1, b"\xc1 not msgpack")  # skipped, not fatal
    stream.receive(2, encode_batch(0.0, [{"type": "SomeLaterEvent"}, block_stored(hashes[:1], None, tokens[:4], 4)]))
    assert matched() == 1


# --------------------------------------------------------------------------------------------------
# A real server: the hashes it publishes are the ones the router computes
# --------------------------------------------------------------------------------------------------


def launch_router(tmp_path, model_dir, server, events_port: int) -> ServerProcess:
    return server_fixtures.launch_router([server.url], tmp_path, "--tokenizer", str(model_dir), "--replica-kv-events",
                                         f"{server.url}=tcp://127.0.0.1:{events_port}", served_model_name="m")


def test_a_server_publishes_the_hashes_the_router_computes_and_the_router_follows_them(tmp_path):
    port = free_port()
    model_dir = make_server_checkpoint(tmp_path / "model")
    config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
    server = launch_server(model_dir, tmp_path, "--num-kv-blocks", "64", "--block-size", "8", "--no-use-kernels",
                           "--max-model-len", "256", "--kv-events-config", config, served_model_name="m")
    router = launch_router(tmp_path, model_dir, server, port)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")

    def index_blocks() -> float:
        return router.metrics().value("pagoda_router_index_blocks", replica=server.url)

    try:
        server.wait_for_health(200)
        router.wait_for_health(200)
        prompt = list(range(7, 7 + 29))  # 3 full blocks of 8 and 5 tokens; cache_salt keys the first block
        with router.client() as client:
            client.completions.create(model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
        stored: list[int] = []
        expected = RoutedPrompt(prompt, "t1").block_hashes(8)
        deadline = time.monotonic() + 10
        while stored[: len(expected)] != expected:
            assert time.monotonic() < deadline, f"published {stored}, the router computes {expected}"
            frames = receive(subscriber, 0.5)
            if frames is not None:
                stored += [h for e in VLLM_DECODER.decode(frames[2]).events if isinstance(e, BlockStored)
                           for h in e.block_hashes]
        # The router learnt them from the events alone (it records nothing itself for such a replica)...
        wait_until(lambda: index_blocks() >= 3, 10, "the router to take in the replica's events")
        with router.client() as client:
            again = client.completions.create(model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
        assert again.usage.prompt_tokens_details.cached_tokens == 24
        assert router.metrics().value("pagoda_router_expected_hit_tokens_total") == 24, "...and expected the hits"
        assert server.post("/reset_prefix_cache").status_code == 200
        cleared = False
        while not cleared:
            assert time.monotonic() < deadline + 10, "no AllBlocksCleared after a reset"
            frames = receive(subscriber, 0.5)
            cleared = frames is not None and any(isinstance(e, AllBlocksCleared)
                                                 for e in VLLM_DECODER.decode(frames[2]).events)
        wait_until(lambda: index_blocks() == 0, 10, "the router to drop the replica's index")
    finally:
        subscriber.close(linger=0)
        router.stop()
        server.stop()
