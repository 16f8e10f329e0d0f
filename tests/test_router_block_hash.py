"""The neutral block-hash module: the chain the router computes is the one the engine's prefix cache keys
its blocks by (same block size, same salt), and importing it pulls in neither torch nor the engine."""

from __future__ import annotations

import subprocess
import sys

from pagoda.block_hash import hash_block, hash_block_chain, max_cacheable_blocks
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import Request
from pagoda.sampling import SamplingParams

BLOCK_SIZE = 4


def cached_hashes_after_prefill(prompt: list[int], cache_salt: str | None) -> set[bytes]:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    request = Request(request_id="r", prompt_token_ids=prompt, params=SamplingParams(max_tokens=4), seed=0,
                      max_model_len=256, cache_salt=cache_salt)
    assert manager.allocate_slots(request, len(prompt)) is not None
    request.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(request)
    return set(manager.pool.cached)


def test_the_chain_is_what_the_engine_registers():
    prompt = list(range(10, 24))  # 3 full blocks and 2 tokens
    for salt in (None, "tenant-a"):
        chain = hash_block_chain(prompt, BLOCK_SIZE, salt)
        assert len(chain) == 3
        assert set(chain) == cached_hashes_after_prefill(prompt, salt)


def test_the_chain_links_blocks_and_the_salt_keys_the_first():
    tokens = list(range(8))
    chain = hash_block_chain(tokens, BLOCK_SIZE)
    assert chain[0] == hash_block(None, tokens[:4])
    assert chain[1] == hash_block(chain[0], tokens[4:])
    assert hash_block_chain(tokens, BLOCK_SIZE, "a")[1] != chain[1], "a salted chain differs throughout"
    assert hash_block_chain(tokens, BLOCK_SIZE, num_blocks=1) == chain[:1]
    assert hash_block_chain(tokens[:3], BLOCK_SIZE) == [], "a partial block has no hash"


def test_the_last_prompt_token_is_never_a_hit():
    assert max_cacheable_blocks(8, BLOCK_SIZE) == 1
    assert max_cacheable_blocks(9, BLOCK_SIZE) == 2
    assert max_cacheable_blocks(0, BLOCK_SIZE) == 0


def test_the_module_and_the_router_core_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import pagoda.block_hash, pagoda.router.core, pagoda.router.policies, pagoda.router.index\n"
            "assert not any(name.startswith('pagoda.engine') for name in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
