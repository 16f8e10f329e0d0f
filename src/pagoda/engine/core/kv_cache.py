"""Paged KV-cache bookkeeping: each request's blocks from the pool (block_pool.py), and prefix hits.

Pure Python over integers; the tensors live in the model runner.

A manager serves one KV cache group (pagoda/kv_groups.py): full attention, or a sliding window, whose blocks
that fell wholly out of the window of every position still to be computed go back to the pool (a request's
table keeps `NULL_BLOCK` in their place). Several groups share one pool (hybrid_kv_cache.py), each caching its
blocks under its own index.

NOTE invariant: num_in_use + num_free == num_blocks, always (free counts cached and empty blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.block_hash import hash_block, hash_block_chain
from pagoda.engine.api import KVEventSink
from pagoda.engine.core.block_pool import (
    NULL_BLOCK,
    WINDOW_PARENT,
    Block,
    BlockParent,
    BlockPool,
    base_root,
    root_of,
)
from pagoda.engine.core.request import Request

__all__ = ["NULL_BLOCK", "Block", "BlockPool", "KVCacheManager", "hash_block"]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventSink | None = None, *, window: int | None = None, pool: BlockPool | None = None,
                 group: int = 0) -> None:
        """window: the group's sliding window (None: full attention). pool, group: the pool this group shares
        with the model's other groups, and its number (group 0's blocks set `Request.block_ids`)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.window = window
        self.group = group
        self.pool = BlockPool(num_blocks, events) if pool is None else pool
        self._blocks: dict[str, list[Block]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # per request: hashes of its full blocks
        # per request: for each registered full block, the identity of the cached block standing for its content
        self._chains: dict[str, list[tuple[int, int]]] = {}
        # per finished request: the leading blocks a KV connector holds for another engine to read (still
        # cached: a hit may share them, and once released they are ordinary cached free blocks)
        self._held: dict[str, list[Block]] = {}

    # --- prefix hits -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks matching the request's tokens, and its token count.

        The last token is never served from the cache: its logits are needed to sample.
        """
        valid = self.hit_lengths(request)
        num_blocks = max(n for n, ok in enumerate(valid) if ok)
        return self.hit_blocks(request, num_blocks), num_blocks * self.block_size

    def hit_lengths(self, request: Request) -> list[bool]:
        """valid[n]: whether a hit of the request's first n blocks is served by this group. A full group needs
        all n cached (a chain); a sliding group the blocks that the position after them still sees (vLLM's
        rule), so a longer hit may be valid where a shorter one is not."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [True]
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = self._cached_blocks(request, max_blocks)
        valid, run = [True], 0
        for n in range(1, max_blocks + 1):
            run = run + 1 if found[n - 1] is not None else 0
            valid.append(run >= n - self._first_kept(n * self.block_size))
        return valid

    def hit_blocks(self, request: Request, num_blocks: int) -> list[Block]:
        """The request's first `num_blocks` cached blocks (a valid hit length), NULL_BLOCK where a window
        dropped them."""
        found = self._cached_blocks(request, num_blocks)
        first = self._first_kept(num_blocks * self.block_size)
        hits = [NULL_BLOCK if index < first else found[index] for index in range(num_blocks)]
        assert all(block is not None for block in hits), "not a valid hit length"
        return [block for block in hits if block is not None]

    def _cached_blocks(self, request: Request, num_blocks: int) -> list[Block | None]:
        """The cached block standing for each of the request's first `num_blocks` blocks (None: not cached). A
        full group's are a chain from the root: none after the first miss."""
        hashes = self._hashes_for(request, num_blocks)
        found: list[Block | None] = []
        for index in range(num_blocks):
            tokens = self._block_tokens(request, index)
            if self.window is not None:
                found.append(self.pool.lookup(hashes[index], tokens, WINDOW_PARENT, self.group))
                continue
            parent = found[-1] if found else None
            if index and parent is None:
                found.append(None)
                continue
            found.append(self.pool.lookup(hashes[index], tokens, root_of(request) if parent is None
                                          else parent.identity, self.group))
        return found

    def _first_kept(self, position: int) -> int:
        """The first block that queries at `position` and after still see (0 without a window)."""
        if self.window is None:
            return 0
        return max(position - self.window + 1, 0) // self.block_size

    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading full blocks of a base-model prompt (never its last token's) the prefix cache holds now.
        Safe to ask from another thread while the engine steps, as a hint only: admission looks again, so a block
        evicted meanwhile is computed then, never read stale."""
        if not self.enable_prefix_caching:
            return 0
        size = self.block_size
        hashes = hash_block_chain(token_ids, size, cache_salt, (len(token_ids) - 1) // size)
        parent: BlockParent = base_root(cache_salt)
        for index, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, token_ids[index * size : (index + 1) * size], parent, self.group)
            if block is None:
                return index
            parent = block.identity
        return len(hashes)

    # --- allocation --------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> list[int] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones and the prefix hits
        `computed_blocks` (whose tokens the caller then counts as computed).

        Returns the request's block ids, or None when the pool cannot supply enough free blocks:
        the caller then preempts or waits. Nothing changes on None but that a sliding group's blocks out of
        the window of the next position are released (no query will read them again).
        """
        self.release_out_of_window(request, request.num_computed_tokens + len(computed_blocks) * self.block_size)
        if self.num_blocks_wanted(request, num_new_tokens, computed_blocks) > self.pool.num_free:
            return None
        self.take_slots(request, num_new_tokens, computed_blocks)
        return request.block_ids

    def num_blocks_wanted(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block]) -> int:
        """Free blocks `take_slots` would take: new ones, and cached ones the hits revive."""
        blocks = self._blocks.get(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        # Reviving a cached (free) block takes it out of the free queue just as a new block would.
        num_revived = sum(1 for block in computed_blocks if block is not NULL_BLOCK and block.ref_count == 0)
        return max(num_needed, 0) + num_revived

    def take_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block]) -> None:
        """allocate_slots' taking, once `num_blocks_wanted` is known to be free."""
        self.share_hits(request, computed_blocks)
        self.take_new_slots(request, num_new_tokens, len(computed_blocks))

    def share_hits(self, request: Request, computed_blocks: Sequence[Block]) -> None:
        """The first half of take_slots. NOTE: every group over the same pool shares its hits before any takes new
        blocks, which would otherwise evict a cached hit at the free queue's front before it is revived."""
        self.pool.share([block for block in computed_blocks if block is not NULL_BLOCK])
        self._blocks.setdefault(request.request_id, []).extend(computed_blocks)

    def take_new_slots(self, request: Request, num_new_tokens: int, num_hit_blocks: int) -> None:
        """The second half of take_slots: blocks for the new tokens past the computed ones and the hits (already
        in the request's blocks)."""
        blocks = self._blocks.setdefault(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(blocks)
        if num_needed > 0:
            blocks.extend(self.pool.take_new(num_needed))
        self._publish(request, blocks)

    def release_out_of_window(self, request: Request, position: int) -> None:
        """Returns the blocks that queries at `position` and after no longer see (a sliding group's) to the
        pool; the table keeps NULL_BLOCK in their place, so positions still map to blocks by index."""
        blocks = self._blocks.get(request.request_id)
        first = self._first_kept(position)
        if not blocks or first == 0:
            return
        dropped = [block for block in blocks[:first] if block is not NULL_BLOCK]
        if dropped:
            blocks[: min(first, len(blocks))] = [NULL_BLOCK] * min(first, len(blocks))
            self.pool.release(dropped)
            self._publish(request, blocks)

    def _publish(self, request: Request, blocks: Sequence[Block]) -> None:
        ids = [block.block_id for block in blocks]
        tables = request.block_tables
        tables.extend([] for _ in range(self.group + 1 - len(tables)))
        tables[self.group] = ids
        if self.group == 0:
            request.block_ids = ids

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._hashes_for(request, num_full)
        chain = self._chains.setdefault(request.request_id, [])
        index_of_group = self.pool.index(self.group)
        stored: list[int] = []  # blocks whose content entered the cache now (not equal to a cached one)
        for index in range(len(chain), num_full):
            block = blocks[index]
            if block is NULL_BLOCK:  # a hit the window dropped at once: cached already
                chain.append(NULL_BLOCK.identity)
                continue
            if self.window is not None:
                parent: BlockParent = WINDOW_PARENT
            else:
                parent = chain[-1] if chain else root_of(request)
            is_new = block.block_hash is None and hashes[index] not in index_of_group
            tokens = self._block_tokens(request, index)
            chain.append(self.pool.register(block, hashes[index], tokens, parent, self.group).identity)
            if is_new:
                stored.append(index)
        if stored and self.events is not None:
            self._report_stored(request, hashes, stored)

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those that hold its first `num_tokens` positions: after a
        speculative step, blocks taken only for the slots of rejected drafts.

        Such blocks were never cached (a block is cached once full of computed, kept tokens, and
        num_tokens is past those), so they go to the head of the free queue, ahead of cached blocks.
        """
        blocks = self._blocks.get(request.request_id, [])
        num_kept = -(-num_tokens // self.block_size)
        if len(blocks) <= num_kept:
            return
        assert num_kept >= len(self._chains.get(request.request_id, ())), "rollback would free a cached block"
        surplus = blocks[num_kept:]
        del blocks[num_kept:]
        self.pool.release(surplus, front=True)
        self._publish(request, blocks)

    def free(self, request: Request, num_held: int = 0) -> None:
        """Returns a finished, aborted or preempted request's blocks to the pool, but its first `num_held`,
        which stay in use until `release_held` (a finished request's, that a KV connector sends elsewhere).

        Last blocks are released first, so they are evicted before the request's first blocks (which
        a later request is more likely to share).
        """
        blocks = [block for block in self._blocks.pop(request.request_id, []) if block is not NULL_BLOCK]
        self._chains.pop(request.request_id, None)
        if num_held:
            assert request.is_finished, "only a finished request's blocks are held"
            self._held[request.request_id] = blocks[:num_held]
            blocks = blocks[num_held:]
        self.pool.release(list(reversed(blocks)))
        request.block_ids = []
        request.block_tables = []
        if request.is_finished:
            self._block_hashes.pop(request.request_id, None)

    def release_held(self, request_id: str) -> None:
        """The held blocks of a finished request go back to the pool (cached, last first); unknown ids are
        ignored."""
        self.pool.release(list(reversed(self._held.pop(request_id, []))))

    @property
    def num_held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._held.values())

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def blocks_of(self, request_id: str) -> list[Block]:
        """The pool blocks a request holds in this group (NULL_BLOCKs left out)."""
        return [block for block in self._blocks.get(request_id, []) if block is not NULL_BLOCK]

    def references(self) -> list[Block]:
        """Every reference this manager holds on pool blocks (requests' and held ones), one per reference."""
        return [block for blocks in [*self._blocks.values(), *self._held.values()] for block in blocks
                if block is not NULL_BLOCK]

    # --- accounting --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def check_invariants(self) -> None:
        in_use = sum(1 for block in self.pool.blocks if block.ref_count > 0)
        assert in_use + self.pool.num_free == self.num_blocks, "block accounting broken"
        assert all(self.pool.blocks[i].ref_count == 0 for i in self.pool.free_queue)
        held: dict[int, int] = {}
        for block in self.references():
            held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0), f"ref count of {block.block_id}"
        for group, index in self.pool.group_cached.items():
            for block_hash, block in index.items():
                assert block.block_hash == block_hash and block.group == group

    # --- helpers -----------------------------------------------------------------------------------

    def _report_stored(self, request: Request, hashes: Sequence[bytes], stored: Sequence[int]) -> None:
        """One BlockStored per run of consecutive new blocks, hanging from the block before the run."""
        assert self.events is not None
        start = 0
        for position in range(1, len(stored) + 1):
            if position < len(stored) and stored[position] == stored[position - 1] + 1:
                continue
            run = stored[start:position]
            tokens = request.all_token_ids[run[0] * self.block_size : (run[-1] + 1) * self.block_size]
            parent = hashes[run[0] - 1] if run[0] > 0 else None
            self.events.blocks_stored([hashes[i] for i in run], parent, tokens, self.block_size)
            start = position

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        start = index * self.block_size
        return request.all_token_ids[start : start + self.block_size]

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` chained block hashes (the KV connector keys stored blocks by them)."""
        return self._hashes_for(request, num_blocks)[:num_blocks]

    def _hashes_for(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended (and memoised) up to `num_blocks`."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else None
            tokens = self._block_tokens(request, len(hashes))
            if request.lora is None:
                hashes.append(hash_block(parent, tokens, request.cache_salt))
            else:
                hashes.append(hash_block(parent, tokens, request.cache_salt, request.lora.key))
        return hashes
