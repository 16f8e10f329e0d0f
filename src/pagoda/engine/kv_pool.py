"""How many KV blocks the engine allocates, and why (the start-up log says both)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import CacheConfig


@dataclass(frozen=True)
class KVPoolSize:
    """The KV pool's size in blocks, and why it has that size."""

    num_blocks: int
    reason: str


def kv_pool_size(cache: CacheConfig, max_num_seqs: int, max_model_len: int, bytes_per_token: int,
                 blocks_per_sequence: int | None = None) -> KVPoolSize:
    """An explicit block count is taken as given. Otherwise the pool is what the engine can use at once,
    max_num_seqs sequences of max_model_len tokens (each in whole blocks), at most kv_cache_memory_bytes:
    a 3M-parameter model with a 512-token context gets its 128 MiB, not the whole 2 GiB budget.

    bytes_per_token: what one token of a block takes. blocks_per_sequence: the blocks a max_model_len sequence
    holds at most (with KV cache groups, every group's: kv_groups.blocks_per_sequence); default, its tokens'."""
    if cache.num_blocks is not None:
        return KVPoolSize(cache.num_blocks, "num_kv_blocks given")
    if blocks_per_sequence is None:
        blocks_per_sequence = -(-max_model_len // cache.block_size)
    needed = max_num_seqs * blocks_per_sequence
    affordable = cache.kv_cache_memory_bytes // (bytes_per_token * cache.block_size)
    if needed <= affordable:
        return KVPoolSize(needed, f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len} tokens")
    return KVPoolSize(
        affordable,
        f"capped by kv_cache_memory_bytes {cache.kv_cache_memory_bytes / 2**20:.0f} MiB "
        f"(max_num_seqs {max_num_seqs} x max_model_len {max_model_len} would take {needed} blocks)",
    )
