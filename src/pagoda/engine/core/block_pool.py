"""The block pool under the KV manager: fixed-size blocks, their ref counts, one LRU free queue and the prefix
cache's index (one per KV cache group). Pure Python over integers.

A block is in exactly one of three states: in use (ref_count > 0), cached (free, but still holding a hash and
its KV), or empty (free, no hash). Free blocks, cached or empty, sit in one LRU queue; allocation takes from its
front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.engine.api import KVEventSink
from pagoda.engine.core.request import Request

__all__ = ["NULL_BLOCK", "WINDOW_PARENT", "Block", "BlockParent", "BlockPool", "base_root", "root_of"]


def root_of(request: Request) -> str:
    """What a request's first block hangs from: its cache salt (tenants never share a first block) and its
    LoRA adapter (an adapter's blocks are never the base model's or another adapter's)."""
    if request.lora is not None:
        return repr(("lora", request.lora.key, request.cache_salt))
    return base_root(request.cache_salt)


def base_root(cache_salt: str | None) -> str:
    """The root of a base-model (no adapter) request's first block under its cache salt."""
    return "root" if cache_salt is None else f"salt:{cache_salt}"


# What a cached block hangs from: the identity of the block before it, or for a first block the root
# that `root_of` names; None while the block is not cached. A sliding group's blocks hang from WINDOW_PARENT:
# the blocks before them may be gone, so a hit there is verified on the block's tokens and its chained hash
# (which names the whole prefix), as vLLM does.
BlockParent = tuple[int, int] | str | None
WINDOW_PARENT = "window"


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
    group: int = 0  # the KV cache group whose cache index holds it, while cached


    @property
    def identity(self) -> tuple[int, int]:
        return self.block_id, self.generation


# Stands in a sliding group's table for a block its window dropped: never in the pool, never written or read
# (the attention metadata points such positions at a written slot, and the window masks them).
NULL_BLOCK = Block(-1)


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventSink | None = None) -> None:
        self.events = events  # told about group 0's blocks (the ones a router can match)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, Block] = {}  # group 0's cache index
        self.group_cached: dict[int, dict[bytes, Block]] = {0: self.cached}  # every group's

    def index(self, group: int) -> dict[bytes, Block]:
        return self.group_cached.setdefault(group, {})

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
                if block.group == 0:
                    evicted.append(block.block_hash)
                del self.group_cached[block.group][block.block_hash]
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

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], parent: BlockParent, group: int = 0
               ) -> Block | None:
        block = self.index(group).get(block_hash)
        if block is None or block.token_ids != tuple(token_ids) or block.parent != parent:
            return None
        return block

    def register(self, block: Block, block_hash: bytes, token_ids: Sequence[int], parent: BlockParent,
                 group: int = 0) -> Block:
        """Caches `block` under its hash and returns the block that now stands for this content: `block`
        itself, or an equal block cached earlier (the same tokens after the same chain), which later
        blocks then name as their parent so that one chain serves every lookup."""
        existing = self.lookup(block_hash, token_ids, parent, group)
        if existing is not None:
            return existing
        index = self.index(group)
        if block.block_hash is None and block_hash not in index:
            block.block_hash, block.token_ids, block.parent, block.group = block_hash, tuple(token_ids), parent, group
            index[block_hash] = block
        return block

    def reset_cache(self) -> int:
        """Forgets every cached hash of free blocks (blocks in use keep theirs). Returns how many."""
        forgotten, count = [], 0
        for group, index in self.group_cached.items():
            for block_hash, block in list(index.items()):
                if block.ref_count == 0:
                    del index[block_hash]
                    block.block_hash, block.token_ids, block.parent = None, (), None
                    count += 1
                    if group == 0:
                        forgotten.append(block_hash)
        if self.events is not None and forgotten:
            if self.cached:  # blocks in use keep their hashes: only the forgotten ones are gone
                self.events.blocks_removed(forgotten)
            else:
                self.events.all_blocks_cleared()
        return count
