"""KVCacheManager without a model: block accounting, block tables, prefix hits, hashing, LRU eviction."""

from __future__ import annotations

import pytest

from pagoda.engine.core import kv_cache as kv_cache_module
from pagoda.engine.core.kv_cache import KVCacheManager, hash_block
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.sampling import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=8),
        seed=0,
        max_model_len=1024,
        cache_salt=cache_salt,
    )


def prefill(manager: KVCacheManager, request: Request) -> None:
    """Admits a request as the scheduler does (prefix hits + slots for the rest), computes its prompt."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_cached_tokens = num_hit_tokens
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def finish(manager: KVCacheManager, request: Request) -> None:
    request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    manager.free(request)


def held_blocks(*requests: Request) -> set[int]:
    return {block_id for request in requests for block_id in request.block_ids}


def test_allocation_and_free_accounting():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    a, b = make_request("a", range(10, 20)), make_request("b", range(30, 35))
    assert manager.allocate_slots(a, 10) is not None
    assert len(a.block_ids) == 3 and manager.num_free_blocks == 7
    assert manager.allocate_slots(b, 5) is not None
    assert len(b.block_ids) == 2 and manager.num_free_blocks == 5
    assert held_blocks(a).isdisjoint(held_blocks(b))
    assert manager.num_used_blocks == 5 and manager.usage() == pytest.approx(0.5)
    manager.check_invariants()
    finish(manager, a)
    assert a.block_ids == [] and manager.num_free_blocks == 8
    finish(manager, b)
    assert manager.num_free_blocks == 10
    manager.check_invariants()


def test_block_table_grows_at_block_boundaries():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(10, 19))  # 9 tokens: 3 blocks, the last holding one token
    manager.allocate_slots(request, 9)
    request.num_computed_tokens = 9
    table_sizes = []
    for token in range(100, 108):  # decode 8 tokens, one at a time
        request.append_token(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        table_sizes.append(len(request.block_ids))
    # Tokens 10..17: a new block exactly when token 13 (index 12) and token 17 (index 16) arrive.
    assert table_sizes == [3, 3, 3, 4, 4, 4, 4, 5]
    first_blocks = list(request.block_ids)
    assert manager.allocate_slots(request, 0) == first_blocks, "a table only grows; old blocks stay put"


def test_allocation_refused_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a, b = make_request("a", range(10, 22)), make_request("b", range(30, 40))
    assert manager.allocate_slots(a, 12) is not None  # 3 blocks
    assert manager.allocate_slots(b, 10) is None  # needs 3, 1 left
    assert b.block_ids == [] and manager.num_free_blocks == 1
    manager.check_invariants()
    assert manager.allocate_slots(b, 4) is not None  # 1 block fits


def test_prefix_hit_on_same_prompt_never_caches_last_token():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks
    first, second = make_request("a", prompt), make_request("b", prompt)
    prefill(manager, first)
    assert first.num_cached_tokens == 0
    prefill(manager, second)
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2], "hit blocks are shared, not copied"
    assert second.block_ids[2] != first.block_ids[2]

    # A prompt of exactly two full blocks: the second block holds the last token, which must be computed.
    exact = list(range(50, 58))
    prefill(manager, make_request("c", exact))
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("d", exact))
    assert num_hit_tokens == 4 and len(hits) == 1
    # A one-block prompt gets nothing from the cache.
    prefill(manager, make_request("e", exact[:4]))
    assert manager.get_computed_blocks(make_request("f", exact[:4])) == ([], 0)
    manager.check_invariants()


def test_freed_blocks_stay_cached_until_reused():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(10, 23))
    first = make_request("a", prompt)
    prefill(manager, first)
    finish(manager, first)
    assert manager.num_free_blocks == 20
    second = make_request("b", prompt)
    prefill(manager, second)
    assert second.num_cached_tokens == 12
    manager.check_invariants()


def test_prefix_caching_disabled_gives_no_hits():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prefill(manager, make_request("a", range(10, 20)))
    assert manager.get_computed_blocks(make_request("b", range(10, 20))) == ([], 0)


def test_hash_chain_covers_tokens_parent_and_salt():
    tokens = [1, 2, 3, 4]
    root = hash_block(None, tokens)
    assert root == hash_block(None, list(tokens)), "stable: same input, same hash"
    assert isinstance(root, bytes) and len(root) >= 16
    assert hash_block(None, [1, 2, 3, 5]) != root
    assert hash_block(root, tokens) != root, "the parent hash is part of the key"
    assert hash_block(hash_block(None, [9, 9, 9, 9]), tokens) != hash_block(root, tokens)
    assert hash_block(None, tokens, "tenant-a") != root
    assert hash_block(None, tokens, "tenant-a") != hash_block(None, tokens, "tenant-b")


def test_cache_salt_separates_tenants():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prompt = list(range(10, 23))
    prefill(manager, make_request("a", prompt, cache_salt="tenant-a"))
    other_tenant = make_request("b", prompt, cache_salt="tenant-b")
    no_salt = make_request("c", prompt)
    same_tenant = make_request("d", prompt, cache_salt="tenant-a")
    assert manager.get_computed_blocks(other_tenant)[1] == 0
    assert manager.get_computed_blocks(no_salt)[1] == 0
    assert manager.get_computed_blocks(same_tenant)[1] == 12


def test_hash_collision_with_different_tokens_is_not_reused(monkeypatch):
    """Every block hashes alike: a hit is only a hit if the stored tokens match."""
    monkeypatch.setattr(kv_cache_module, "hash_block", lambda parent, tokens, extra=None: b"collision")
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", range(10, 19)))
    assert manager.get_computed_blocks(make_request("b", range(50, 59))) == ([], 0)
    # Its own tokens still hit (the first block, which registered the colliding hash).
    assert manager.get_computed_blocks(make_request("c", range(10, 19)))[1] == 4


def test_lru_evicts_a_freed_requests_last_blocks_before_its_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(10, 23))  # 13 tokens: 3 full cached blocks + 1 block with the last token
    first = make_request("a", prompt)
    prefill(manager, first)
    first_blocks = list(first.block_ids)
    finish(manager, first)
    # Another request needs 2 blocks: they must come from the tail of `first` (its 4th and 3rd).
    other = make_request("b", range(100, 108))
    assert manager.allocate_slots(other, 8) is not None
    assert sorted(other.block_ids) == sorted(first_blocks[2:])
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", prompt))
    assert num_hit_tokens == 8, "the first two blocks should have survived; the third was evicted"
    assert [block.block_id for block in hits] == first_blocks[:2]


def test_shared_block_survives_one_owner_freeing():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    prompt = list(range(10, 20))
    first, second = make_request("a", prompt), make_request("b", prompt)
    prefill(manager, first)
    prefill(manager, second)
    shared = set(first.block_ids) & set(second.block_ids)
    assert len(shared) == 2
    finish(manager, first)
    manager.check_invariants()
    assert manager.num_free_blocks == 6 - len(second.block_ids)
    # The shared blocks are still in use: allocating everything else must not hand them out.
    third = make_request("x", range(200, 212))
    assert manager.allocate_slots(third, manager.num_free_blocks * BLOCK_SIZE) is not None
    assert shared.isdisjoint(third.block_ids)
    finish(manager, second)
    finish(manager, third)
    assert manager.num_free_blocks == 6
    manager.check_invariants()


def test_preempted_request_keeps_hashes_and_hits_its_own_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", range(10, 19))
    prefill(manager, request)
    for token in (100, 101, 102):
        request.append_token(token)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request)
    manager.free(request)  # preempted: not finished
    request.num_computed_tokens = 0
    assert manager.num_free_blocks == 10
    hits, num_hit_tokens = manager.get_computed_blocks(request)  # 12 tokens: 3 full blocks, last not hit
    assert num_hit_tokens == 8
