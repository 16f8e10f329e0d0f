"""The hybrid KV manager without a model: KV cache groups from a model's windows, a sliding group releasing the
blocks out of its window while a full group keeps everything, allocation all-or-nothing across groups, prefix
hits under vLLM's sliding rule, and every block back in the pool at the end."""

from __future__ import annotations

import math

import pytest

from pagoda.config import SchedulerConfig
from pagoda.engine.api import TenantShare
from pagoda.engine.core.hybrid_kv_cache import HybridKVCacheManager, make_kv_cache_manager
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.queues import blocks_held_by_tenant, make_waiting_queue
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.kv_groups import KVCacheGroup, blocks_per_sequence, is_hybrid, kv_cache_groups, layer_tensor_index
from pagoda.sampling import SamplingParams

BLOCK_SIZE = 4
WINDOW = 8
GEMMA2 = (KVCacheGroup(None, (1,)), KVCacheGroup(WINDOW, (0,)))


def make_request(request_id: str, prompt: list[int] | range) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=64),
                   seed=0, max_model_len=1024)


def admit(manager: KVCacheManager, request: Request, chunk: int | None = None) -> int:
    """Admits a request (prefix hits, then a chunk or the rest of its prompt), computes it; returns its hit."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens if chunk is None else chunk
    assert manager.allocate_slots(request, num_new, hits) is not None
    request.num_computed_tokens = num_hit_tokens + num_new
    manager.cache_full_blocks(request)
    return num_hit_tokens


def decode(manager: KVCacheManager, request: Request, token: int) -> None:
    """One decode step as the scheduler and the runner do it: a slot for the last token, then a new token."""
    assert manager.allocate_slots(request, 1) is not None
    request.append_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    manager.cache_full_blocks(request)


def finish(manager: KVCacheManager, request: Request) -> None:
    request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    manager.free(request)


def test_groups_of_each_layout():
    assert kv_cache_groups((), 4, 128) == (KVCacheGroup(None, (0, 1, 2, 3)),)
    assert not is_hybrid(kv_cache_groups((None, None), 2, 128))
    # Gemma 2: alternating; Gemma 3: 5 sliding to 1 full, split into groups of the full layers' count.
    assert kv_cache_groups((8, None, 8, None), 4, 128) == (KVCacheGroup(None, (1, 3)), KVCacheGroup(8, (0, 2)))
    gemma3 = kv_cache_groups((8, 8, 8, 8, 8, None) * 2, 12, 128)
    assert [g.window for g in gemma3] == [None] + [8] * 5 and all(len(g.layers) == 2 for g in gemma3)
    # Sliding layers (0, 1), (2, 3), (4, 6), (7, 8), (9, 10); full (5, 11): each its place in its group.
    assert layer_tensor_index(gemma3, 12) == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    # Mistral: every layer slides, one group; a window no shorter than the context is full attention.
    assert kv_cache_groups((8, 8), 2, 128) == (KVCacheGroup(8, (0, 1)),)
    assert not is_hybrid(kv_cache_groups((128, None), 2, 128))
    # A 100-token sequence in blocks of 4 with W = 8: 25 full blocks, and 3 (+ a step's chunk) sliding.
    assert blocks_per_sequence(GEMMA2, 100, 4) == 25 + 3
    assert blocks_per_sequence(GEMMA2, 100, 4, chunk=16) == 25 + 7


def test_the_single_table_manager_is_kept_where_nothing_slides():
    assert type(make_kv_cache_manager(8, 4, kv_cache_groups((), 2, 64))) is KVCacheManager
    assert isinstance(make_kv_cache_manager(8, 4, GEMMA2), HybridKVCacheManager)


@pytest.mark.parametrize("groups", [GEMMA2, (KVCacheGroup(WINDOW, (0, 1)),)], ids=["gemma2", "mistral"])
def test_a_long_decode_holds_the_window_in_sliding_groups_and_everything_in_full_ones(groups):
    """Counted: at every step, each sliding group holds at most ceil(W / block) + 1 blocks, a full group every
    block of the sequence; the pool's free count is the baseline's plus the blocks the windows released."""
    manager = HybridKVCacheManager(64, BLOCK_SIZE, groups)
    baseline = KVCacheManager(64, BLOCK_SIZE)
    request, twin = make_request("a", range(1, 11)), make_request("a", range(1, 11))
    admit(manager, request)
    admit(baseline, twin)
    bound = math.ceil(WINDOW / BLOCK_SIZE) + 1
    for step in range(60):
        decode(manager, request, 100 + step)
        decode(baseline, twin, 100 + step)
        held = manager.blocks_held("a")
        full_blocks = math.ceil(request.num_computed_tokens / BLOCK_SIZE)  # every computed position has a slot
        for group, count in zip(groups, held):
            assert count <= bound if group.window is not None else count == full_blocks
        assert manager.num_free_blocks == 64 - sum(held)
        assert baseline.num_free_blocks == 64 - full_blocks
        manager.check_invariants()
    # The tables still map positions to blocks by index: dropped blocks are -1, the window's are real.
    sliding_table = request.block_tables[-1]
    assert len(sliding_table) == full_blocks
    assert sliding_table[0] == -1 and -1 not in sliding_table[-(bound - 1):]
    finish(manager, request)
    assert manager.num_free_blocks == 64 and request.block_tables == []
    manager.check_invariants()


def test_allocation_is_all_groups_or_none():
    manager = HybridKVCacheManager(5, BLOCK_SIZE, GEMMA2)
    request = make_request("a", range(1, 13))  # 3 blocks in each group: 6 > 5
    hits, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 12, hits) is None
    assert manager.num_free_blocks == 5 and manager.blocks_held("a") == [0, 0]
    assert manager.allocate_slots(request, 8, hits) is not None  # a chunk of 8: 2 + 2
    manager.check_invariants()
    finish(manager, request)
    assert manager.num_free_blocks == 5


def test_a_chunked_prefill_releases_the_blocks_behind_each_chunk():
    manager = HybridKVCacheManager(64, BLOCK_SIZE, GEMMA2)
    request = make_request("a", range(1, 41))
    for _ in range(5):
        hits, _ = manager.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
        assert manager.allocate_slots(request, 8, hits) is not None
        request.num_computed_tokens += 8
        manager.cache_full_blocks(request)
    # The last chunk computed positions 32..39, seeing keys from 25: blocks 6.. of the sliding group.
    assert manager.blocks_held("a") == [10, 4]
    finish(manager, request)
    manager.check_invariants()


def test_a_prefix_hit_needs_the_sliding_groups_window_blocks_only():
    """vLLM's rule: the sliding group's blocks before the window may be gone, the window's must be cached."""
    manager = HybridKVCacheManager(64, BLOCK_SIZE, GEMMA2)
    first = make_request("a", range(1, 42))
    admit(manager, first)
    finish(manager, first)
    # Every block is cached: a 41-token prompt's 10 full blocks hit; the sliding group serves only the blocks
    # the next position (40) sees, 33.. = blocks 8 and 9, and takes nothing for the ones before.
    again = make_request("b", range(1, 42))
    assert admit(manager, again) == 40
    assert manager.blocks_held("b") == [11, 3]
    assert again.block_tables[1][:8] == [-1] * 8
    finish(manager, again)
    manager.check_invariants()
    assert manager.num_free_blocks == 64


def test_a_sliding_hit_falls_back_when_its_window_was_evicted():
    manager = HybridKVCacheManager(64, BLOCK_SIZE, (KVCacheGroup(WINDOW, (0,)),))
    first = make_request("a", range(1, 42))
    admit(manager, first)
    table = list(first.block_tables[0])
    finish(manager, first)
    # Evict block 9 (positions 36..39): a hit of 10 blocks would need it, a hit of 9 (next position 36, seeing
    # 29..) needs blocks 7 and 8 only.
    victim = manager.pool.blocks[table[9]]
    del manager.pool.index(0)[victim.block_hash]
    victim.block_hash, victim.token_ids, victim.parent = None, (), None
    again = make_request("b", range(1, 42))
    assert admit(manager, again) == 36
    finish(manager, again)
    manager.check_invariants()
    assert manager.num_free_blocks == 64


def test_preempting_and_recomputing_keeps_the_accounting():
    manager = HybridKVCacheManager(64, BLOCK_SIZE, GEMMA2)
    request = make_request("a", range(1, 30))
    admit(manager, request)
    for step in range(10):
        decode(manager, request, 200 + step)
    manager.free(request)  # preempted: recomputed from scratch, its cached blocks hit again
    request.num_computed_tokens = 0
    assert admit(manager, request) == (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    manager.check_invariants()
    finish(manager, request)
    assert manager.num_free_blocks == 64


def test_a_hit_at_the_free_queues_front_is_revived_before_another_group_takes_new_blocks():
    """A sliding group's cached hit at the LRU front must not be handed to the full group as a new block (its
    KV then overwritten under the hit)."""
    manager = HybridKVCacheManager(6, BLOCK_SIZE, GEMMA2)
    first = make_request("a", range(1, 10))  # 3 blocks in each group, 2 of them full and cached
    admit(manager, first)
    sliding_first_block = first.block_tables[1][0]
    finish(manager, first)
    manager.pool.free_queue.move_to_end(sliding_first_block, last=False)
    again = make_request("b", range(1, 10))
    assert admit(manager, again) == 8
    full_table, sliding_table = again.block_tables
    assert sliding_table[0] == sliding_first_block and not set(full_table) & set(sliding_table)
    assert manager.pool.blocks[sliding_first_block].block_hash is not None
    finish(manager, again)
    manager.check_invariants()


def test_a_tenants_kv_blocks_count_every_groups_pool_blocks():
    """The quota (`max_kv_blocks`) and the pagoda:tenant_kv_blocks gauge count what a request holds in the pool:
    both groups' blocks, not group 0's table alone, and not the places a window dropped."""
    manager = HybridKVCacheManager(64, BLOCK_SIZE, GEMMA2)
    request = make_request("a", range(1, 42))
    request.tenant = TenantShare("a", max_kv_blocks=12)
    other = make_request("b", range(100, 104))
    other.tenant = TenantShare("b")
    for each in (request, other):
        admit(manager, each)
    decode(manager, request, 200)  # position 41 sees 34..: the sliding group lets blocks 0..7 go
    assert manager.blocks_held("a") == [11, 3] and request.block_tables[1][:8] == [-1] * 8
    assert blocks_held_by_tenant([request, other]) == {"a": 14, "b": 2}
    # Group 0's table alone (11 blocks) is under the quota of 12; the pool blocks (14) are over it.
    queue = make_waiting_queue(SchedulerConfig())
    running = [request, other]
    queue.order_running(running)
    assert [r.request_id for r in running] == ["b", "a"]
    for each in (request, other):
        finish(manager, each)
    assert manager.num_free_blocks == 64
