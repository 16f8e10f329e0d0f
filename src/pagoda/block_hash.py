"""Prefix-cache block hashes: the one definition the engine's KV cache and the router both import.

A full block's hash chains its parent block's hash, its token ids and, for a first block, the request's
extra keys: the cache salt (tenants never share a first block, hence no later one) and the LoRA adapter's
identity (an adapter's blocks are never the base model's, nor another adapter's). A request with neither
hashes exactly as before either existed, so the router's hashes of base-model prompts stay the engine's. sha256 over the
tokens' little-endian bytes, never Python's hash(): another process computes the same values.

Imports nothing but the standard library, so the router (which knows no engine and no torch) can use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROOT_SEED = b"pagoda-root"
TOKEN_BYTES = 4  # token ids are written as unsigned 32-bit little-endian integers


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None = None,
               adapter: str | None = None) -> bytes:
    """A stable hash (sha256) chaining the parent block's hash, this block's tokens and extra keys (the cache
    salt; the adapter's identity, engine/core/lora.py's AdapterId.key)."""
    hasher = hashlib.sha256(parent_hash or ROOT_SEED)
    if adapter is not None and parent_hash is None:
        # Length-prefixed, and before the salt: no salt, adapter or token bytes can spell another's.
        key = adapter.encode()
        hasher.update(b"lora:" + len(key).to_bytes(8, "little") + key)
    if extra_key is not None and parent_hash is None:
        hasher.update(b"salt:" + extra_key.encode())
    hasher.update(b"".join(t.to_bytes(TOKEN_BYTES, "little", signed=False) for t in token_ids))
    return hasher.digest()


def hash_block_chain(
    token_ids: Sequence[int], block_size: int, extra_key: str | None = None, num_blocks: int | None = None
) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids` (at most `num_blocks` of them), exactly as the
    engine registers them in its prefix cache. A partial last block has no hash."""
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    hashes: list[bytes] = []
    for index in range(num_full):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[index * block_size : (index + 1) * block_size], extra_key))
    return hashes


def max_cacheable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many of a prompt's blocks a prefix-cache hit can cover: the last prompt token is always
    computed (its logits are sampled), so a prompt of exactly k blocks can hit at most k - 1."""
    return max(num_prompt_tokens - 1, 0) // block_size


def wire_block_hash(block_hash: bytes) -> int:
    """A block hash as KV events carry it (vLLM's events type hashes as integers that msgpack holds in 64 bits):
    the first 8 bytes of the sha256, big-endian, unsigned. The router keys its index by the same value."""
    return int.from_bytes(block_hash[:8], "big")
