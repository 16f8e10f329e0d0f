"""The hybrid KV manager: one pool, a block table per KV cache group (vLLM v1's hybrid KV cache manager).

A model with sliding-window layers has several groups (pagoda/kv_groups.py): full ones keep every block of a
request, sliding ones release the blocks that fell out of their window as the request advances. The manager
is group 0's `KVCacheManager` (which sets `Request.block_ids`) with the other groups' managers beside it, all
over the same `BlockPool`; the scheduler sees one manager. Chosen at construction for a model whose layout
`kv_groups.is_hybrid` says differs from one table over every layer.

Every group allocates for a step or none does (the free blocks are counted for all groups at once), and a
prefix hit is the longest length every group serves: the full groups' cached chain, and each sliding group's
blocks within the window of the position after the hit (vLLM's rule). Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.engine.api import KVEventSink
from pagoda.engine.core.block_pool import Block
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import Request
from pagoda.kv_groups import KVCacheGroup


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroup],
                 enable_prefix_caching: bool = True, events: KVEventSink | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, events, window=groups[0].window)
        self.groups = tuple(groups)
        self.others = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, window=group.window,
                                      pool=self.pool, group=index)
                       for index, group in enumerate(groups[1:], 1)]

    @property
    def managers(self) -> list[KVCacheManager]:
        """Every group's manager, group 0 (this one) first."""
        return [self, *self.others]

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        lengths = [super().hit_lengths(request), *(other.hit_lengths(request) for other in self.others)]
        num_blocks = max(n for n in range(len(lengths[0])) if all(valid[n] for valid in lengths))
        return self.hit_blocks(request, num_blocks), num_blocks * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> list[int] | None:
        num_hits = len(computed_blocks)
        position = request.num_computed_tokens + num_hits * self.block_size
        hits = [list(computed_blocks), *(other.hit_blocks(request, num_hits) for other in self.others)]
        for manager in self.managers:
            manager.release_out_of_window(request, position)
        wanted = sum(manager.num_blocks_wanted(request, num_new_tokens, blocks)
                     for manager, blocks in zip(self.managers, hits))
        if wanted > self.pool.num_free:
            return None
        for manager, blocks in zip(self.managers, hits):  # every group's hits revived before any new block is taken
            manager.share_hits(request, blocks)
        for manager in self.managers:
            manager.take_new_slots(request, num_new_tokens, num_hits)
        return request.block_ids

    def cache_full_blocks(self, request: Request) -> None:
        super().cache_full_blocks(request)
        for other in self.others:
            other.cache_full_blocks(request)

    def rollback(self, request: Request, num_tokens: int) -> None:
        super().rollback(request, num_tokens)
        for other in self.others:
            other.rollback(request, num_tokens)

    def free(self, request: Request, num_held: int = 0) -> None:
        assert num_held == 0, "a KV connector does not run with a hybrid KV cache"
        for other in self.others:
            other.free(request)
        super().free(request)

    def references(self) -> list[Block]:
        return [*super().references(), *(block for other in self.others for block in other.references())]

    def blocks_held(self, request_id: str) -> list[int]:
        """Pool blocks the request holds in each group (the window's bound on a sliding group is counted here)."""
        return [len(manager.blocks_of(request_id)) for manager in self.managers]


def make_kv_cache_manager(num_blocks: int, block_size: int, groups: Sequence[KVCacheGroup],
                          enable_prefix_caching: bool = True, events: KVEventSink | None = None) -> KVCacheManager:
    """The single-table manager for a model of one full group (no windows), else the hybrid one."""
    if len(groups) == 1 and groups[0].window is None:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching, events)
    return HybridKVCacheManager(num_blocks, block_size, groups, enable_prefix_caching, events)
