"""The router's index by medium (KV events' `medium`): a replica's pool, its offload tier, and the one store every
replica shares, whose blocks are a hit for every replica; and the positional events of earlier vLLM releases."""

from __future__ import annotations

import msgpack

from pagoda.block_hash import hash_block_chain, wire_block_hash
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.events import EventStream
from pagoda.router.policies import RoutedPrompt
from pagoda.wire.kv_events import all_blocks_cleared, block_removed, block_stored, encode_batch

BLOCK_SIZE = 4


def test_the_router_reads_the_positional_events_of_earlier_vllm_releases():
    router = Router(["http://a"], RouterConfig(default_block_size=BLOCK_SIZE), event_endpoints={"http://a": "tcp://a:1"})
    replica = router.replicas[0]
    tokens = list(range(100, 113))
    wire = [wire_block_hash(h) for h in hash_block_chain(tokens, BLOCK_SIZE)]
    stream = EventStream(router, replica)
    v090 = msgpack.packb([0.0, [["BlockStored", wire, None, tokens[:12], BLOCK_SIZE, None], ["SomeLaterEvent"]]])
    stream.receive(0, v090)
    assert replica.match(RoutedPrompt(tokens).cacheable(BLOCK_SIZE), router.clock()) == 3
    with_medium = msgpack.packb([0.0, [["BlockRemoved", wire[2:], "GPU"], ["BlockStored", wire[:1], None,
                                                                          tokens[:4], BLOCK_SIZE, None, "CPU", None]]])
    stream.receive(1, with_medium)
    assert len(replica.index) == 2 and len(replica.offload_index) == 1


def test_a_block_in_the_shared_store_is_a_hit_for_every_replica_and_an_offloaded_one_for_its_own():
    urls = ["http://a", "http://b", "http://c"]
    router = Router(urls, RouterConfig(default_block_size=BLOCK_SIZE),
                    event_endpoints={url: f"tcp://{url[7:]}:1" for url in urls})
    a, b, c = router.replicas
    tokens = list(range(200, 217))  # 4 full blocks
    prompt = RoutedPrompt(tokens)
    hashes = hash_block_chain(tokens, BLOCK_SIZE)

    def matched(replica) -> int:
        return replica.match(prompt.cacheable(BLOCK_SIZE), router.clock())

    EventStream(router, a).receive(0, encode_batch(0.0, [block_stored(hashes[:2], None, tokens[:8], BLOCK_SIZE,
                                                                      medium="SHARED")]))
    assert [matched(r) for r in (a, b, c)] == [2, 2, 2], "a shared block counts on every replica"
    EventStream(router, b).receive(0, encode_batch(0.0, [
        block_stored(hashes[2:3], hashes[1], tokens[8:12], BLOCK_SIZE, medium="CPU"),
        block_stored(hashes[3:], hashes[2], tokens[12:16], BLOCK_SIZE)]))
    assert [matched(r) for r in (a, b, c)] == [2, 4, 2], "b's own tiers continue the shared prefix"
    EventStream(router, b).receive(1, encode_batch(0.0, [block_removed(hashes[3:])]))
    assert matched(b) == 3, "a block gone from the pool is still in b's offload tier"
    EventStream(router, b).receive(2, encode_batch(0.0, [block_stored(hashes[3:], hashes[2], tokens[12:], 4),
                                                         all_blocks_cleared()]))
    assert matched(b) == 3, "a pool reset leaves the tiers"
    router.set_health(b, True)
    router.set_health(b, False)  # an outage: b may come back empty, the shared store has not moved
    assert [matched(r) for r in (a, b, c)] == [2, 2, 2]
    for replica in router.replicas:
        router.set_health(replica, True)
    assert router.choose(prompt).matched_blocks == 2
