"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, ref counts, and a prefix-hash map.

Pure Python over integers; the tensors live in the model runner. A block is in exactly one of three
states: in use (ref_count > 0), cached (free, but still holding a hash and its KV), or empty (free,
no hash). Free blocks, cached or empty, sit in one LRU queue; allocation takes from its front.

NOTE invariant: num_in_use + num_free == num_blocks, always (free counts cached and empty blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.block_hash import hash_block, hash_block_chain
from pagoda.engine.api import KVEventSink
from pagoda.engine.core.request import Request

__all__ = ["Block", "BlockPool", "KVCacheManager", "hash_block"]


def _root(request: Request) -> str:
    """What a request's first block hangs from: its cache salt (tenants never share a first block) and its
    LoRA adapter (an adapter's blocks are never the base model's or another adapter's)."""
    if request.lora is not None:
        return repr(("lora", request.lora.key, request.cache_salt))
    return _base_root(request.cache_salt)


def _base_root(cache_salt: str | None) -> str:
    return "root" if cache_salt is None else f"salt:{cache_salt}"


# What a cached block hangs from: the identity of the block before it, or for a first block the root
# that `_root` names; None while the block is not cached.
BlockParent = tuple[int, int] | str | None


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # What a hit is verified against (never trusted on the hash alone): the block's own tokens, and the
    # physical block that preceded it (id and reuse generation; the root for a first block).
    token_ids: tuple[int, ...] = ()
    parent: BlockParent = None
    generation: int = 0  # bumped each time the block is handed out afresh

    @property
    def identity(self) -> tuple[int, int]:
        return self.block_id, self.generation


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventSink | None = None) -> None:
        self.events = events
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take_new(self, count: int) -> list[Block]:
        """Pops `count` blocks from the LRU front, evicting their cached content."""
        taken, evicted = [], []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids, block.parent = None, (), None
            block.generation += 1
            block.ref_count = 1
            taken.append(block)
        if evicted and self.events is not None:
            self.events.blocks_removed(evicted)
        return taken

    def share(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Sequence[Block], front: bool = False) -> None:
        """Drops one reference from each block; blocks reaching zero join the LRU tail in this order (with
        `front`, the head, to be taken first: for blocks holding nothing worth keeping)."""
        for block in blocks:
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} released twice"
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                if front:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent: BlockParent) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids) or block.parent != parent:
            return None
        return block

    def register(self, block: Block, block_hash: bytes, token_ids: Sequence[int], parent: BlockParent) -> Block:
        """Caches `block` under its hash and returns the block that now stands for this content: `block`
        itself, or an equal block cached earlier (the same tokens after the same chain), which later
        blocks then name as their parent so that one chain serves every lookup."""
        existing = self.lookup(block_hash, token_ids, parent)
        if existing is not None:
            return existing
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.token_ids, block.parent = block_hash, tuple(token_ids), parent
            self.cached[block_hash] = block
        return block

    def reset_cache(self) -> int:
        """Forgets every cached hash of free blocks (blocks in use keep theirs). Returns how many."""
        forgotten = []
        for block_hash, block in list(self.cached.items()):
            if block.ref_count == 0:
                del self.cached[block_hash]
                block.block_hash, block.token_ids, block.parent = None, (), None
                forgotten.append(block_hash)
        if self.events is not None and forgotten:
            if self.cached:  # blocks in use keep their hashes: only the forgotten ones are gone
                self.events.blocks_removed(forgotten)
            else:
                self.events.all_blocks_cleared()
        return len(forgotten)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventSink | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.pool = BlockPool(num_blocks, events)
        self._blocks: dict[str, list[Block]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # per request: hashes of its full blocks
        # per request: for each registered full block, the cached block standing for its content
        self._chains: dict[str, list[Block]] = {}
        # per finished request: the leading blocks a KV connector holds for another engine to read (still
        # cached: a hit may share them, and once released they are ordinary cached free blocks)
        self._held: dict[str, list[Block]] = {}

    # --- prefix hits -------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks matching the request's tokens, and its token count.

        The last token is never served from the cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes_for(request, max_blocks)
        hits: list[Block] = []
        for index, block_hash in enumerate(hashes[:max_blocks]):
            parent = hits[-1].identity if hits else _root(request)
            block = self.pool.lookup(block_hash, self._block_tokens(request, index), parent)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """How many leading full blocks of a base-model prompt (never its last token's) the prefix cache holds now.
        Safe to ask from another thread while the engine steps, as a hint only: admission looks again, so a block
        evicted meanwhile is computed then, never read stale."""
        if not self.enable_prefix_caching:
            return 0
        size = self.block_size
        hashes = hash_block_chain(token_ids, size, cache_salt, (len(token_ids) - 1) // size)
        parent: BlockParent = _base_root(cache_salt)
        for index, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, token_ids[index * size : (index + 1) * size], parent)
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
        the caller then preempts or waits. Nothing changes on None.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        num_hit_tokens = len(computed_blocks) * self.block_size
        num_total_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(blocks) - len(computed_blocks)
        # Reviving a cached (free) block takes it out of the free queue just as a new block would.
        num_revived = sum(1 for block in computed_blocks if block.ref_count == 0)
        if max(num_needed, 0) + num_revived > self.pool.num_free:
            return None
        self.pool.share(computed_blocks)
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.take_new(num_needed))
        request.block_ids = [block.block_id for block in blocks]
        return request.block_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._hashes_for(request, num_full)
        chain = self._chains.setdefault(request.request_id, [])
        stored: list[int] = []  # blocks whose content entered the cache now (not equal to a cached one)
        for index in range(len(chain), num_full):
            parent = chain[-1].identity if chain else _root(request)
            is_new = blocks[index].block_hash is None and hashes[index] not in self.pool.cached
            chain.append(self.pool.register(blocks[index], hashes[index], self._block_tokens(request, index), parent))
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
        request.block_ids = [block.block_id for block in blocks]

    def free(self, request: Request, num_held: int = 0) -> None:
        """Returns a finished, aborted or preempted request's blocks to the pool, but its first `num_held`,
        which stay in use until `release_held` (a finished request's, that a KV connector sends elsewhere).

        Last blocks are released first, so they are evicted before the request's first blocks (which
        a later request is more likely to share).
        """
        blocks = self._blocks.pop(request.request_id, [])
        self._chains.pop(request.request_id, None)
        if num_held:
            assert request.is_finished, "only a finished request's blocks are held"
            self._held[request.request_id] = blocks[:num_held]
            blocks = blocks[num_held:]
        self.pool.release(list(reversed(blocks)))
        request.block_ids = []
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
        for blocks in [*self._blocks.values(), *self._held.values()]:
            for block in blocks:
                held[block.block_id] = held.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0), f"ref count of {block.block_id}"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash

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
