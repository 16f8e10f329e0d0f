"""The quantized KV cache in the engine: the pool's size follows the format (calc's formula), the flag's
spellings and refusals, and greedy output with int8 KV unchanged by everything around the cache (chunked
prefill, preemption, prefix caching, n-gram and draft-model speculation, KV events, tensor parallelism).

With int8 KV a token's K/V is quantized alone (per token and head), so its codes do not depend on what shares
its step: an int8 engine's greedy output under any of those is the plain int8 engine's, up to the near-tie
rule (fp32 sums in another order may flip a near-tied choice).
"""

from __future__ import annotations

import argparse

import pytest
from conftest import random_prompts

from pagoda import LLM, SamplingParams
from pagoda.calc import formulas
from pagoda.config import CacheConfig
from pagoda.engine.engine import LLMEngine
from pagoda.engine_args import add_engine_args, engine_config_from
from pagoda.entrypoints import build_engine_config

MAX_TOKENS = 12
NEAR_TIE_LOGPROB = 1e-3  # fp32: a divergence is excused only where the baseline's top two were this close
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
# Prompts sharing a 24-token prefix (whole blocks of 4: prefix-cache hits), a short one, and one repeating itself
# (n-gram drafts).
PREFIX = random_prompts([24], seed=5)[0]
PROMPTS = ([PREFIX + tail for tail in random_prompts([3, 17, 9], seed=6)] + random_prompts([2], seed=7)
           + [random_prompts([6], seed=8)[0] * 4])


def greedy(llm: LLM, prompts=PROMPTS):
    return [output.outputs[0] for output in llm.generate(prompts, PARAMS, use_tqdm=False)]


def assert_same_greedy(actual, baseline, label: str) -> None:
    ties = 0
    for index, (got, want) in enumerate(zip(actual, baseline)):
        diverged = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if diverged is None:
            assert len(got.token_ids) == len(want.token_ids), f"{label}/prompt {index}"
            continue
        top = sorted(want.logprobs[diverged].values(), reverse=True)
        assert top[0] - top[1] < NEAR_TIE_LOGPROB, f"{label}/prompt {index} diverged at {diverged}: {top[:2]}"
        ties += 1
    assert ties <= 1, f"{label}: {ties} near-ties"


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    """Weights at std 0.1: greedy output falls into loops, so n-gram drafts are proposed (and often right)."""
    return checkpoint("llama", init_std=0.1)


@pytest.fixture(scope="module")
def baseline(model_dir):
    """The plain int8 engine: everything in one step, no prefix cache, no speculation."""
    with LLM(str(model_dir), kv_cache_dtype="int8", num_kv_blocks=256, block_size=4,
             enable_prefix_caching=False) as llm:
        return greedy(llm)


# --- the pool ------------------------------------------------------------------------------------------------


def pool_tokens(model_dir, **options) -> int:
    with LLM(str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=4 << 20, max_num_seqs=1024,
             **options) as llm:
        kv = llm.engine.describe().kv_cache
        return kv.num_blocks * kv.block_size


def test_pool_holds_what_calc_predicts_per_format(checkpoint):
    """At the same --kv-cache-memory-bytes, the pool's tokens scale as calc's bytes per token: int8 at head_dim
    64 stores 64 + 4 (its scale) bytes a head where bf16 stores 128 (1.88x the tokens), fp8 64 (2x)."""
    model_dir = checkpoint("llama", hidden_size=128, num_heads=2, num_kv_heads=2)  # head_dim 64
    bf16 = pool_tokens(model_dir)
    predicted = {
        fmt: formulas.kv_bytes_per_token(2, 2, 64, "bf16") / formulas.kv_bytes_per_token(2, 2, 64, fmt)
        for fmt in ("int8", "fp8")
    }
    assert predicted["int8"] == pytest.approx(128 / 68) and predicted["fp8"] == 2.0
    for fmt in ("int8", "fp8"):
        measured = pool_tokens(model_dir, kv_cache_dtype=fmt) / bf16
        assert measured == pytest.approx(predicted[fmt], rel=0.02), f"{fmt}: {measured:.3f}x"


def test_the_description_reports_the_kv_format(model_dir):
    with LLM(str(model_dir), kv_cache_dtype="fp8", num_kv_blocks=8) as llm:
        kv = llm.engine.describe().kv_cache
        assert kv.dtype == "fp8_e4m3"
        assert kv.num_bytes == 8 * 16 * 2 * 2 * 2 * 16  # blocks x tokens x K,V x layers x kv heads x head_dim bytes
    with LLM(str(model_dir), num_kv_blocks=8) as llm:
        assert llm.engine.describe().kv_cache.dtype == "float32"


# --- the flag ------------------------------------------------------------------------------------------------


def test_kv_cache_dtype_spellings_and_refusals(model_dir):
    assert CacheConfig(cache_dtype="fp8").cache_dtype == "fp8_e4m3"
    assert build_engine_config(str(model_dir), kv_cache_dtype="INT8").cache.cache_dtype == "int8"
    with pytest.raises(ValueError, match=r"'fp8_e5m2': pagoda stores fp8 as e4m3 only .*supported: auto, fp8, "
                                         r"fp8_e4m3, int8"):
        build_engine_config(str(model_dir), kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        CacheConfig(cache_dtype="int4")
    with pytest.raises(ValueError, match="calculate_kv_scales applies to kv_cache_dtype fp8 only"):
        build_engine_config(str(model_dir), kv_cache_dtype="int8", calculate_kv_scales=True)


def test_cli_flags(model_dir, capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(model_dir), "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    cache = engine_config_from(args).cache
    assert (cache.cache_dtype, cache.calculate_kv_scales) == ("fp8_e4m3", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert "fp8_e5m2': pagoda stores fp8 as e4m3 only" in capsys.readouterr().err


# --- greedy output under the engine's features ------------------------------------------------------------------


def test_chunked_prefill_preemption_and_prefix_hits(model_dir, baseline, make_llm):
    llm = make_llm(model_dir, kv_cache_dtype="int8", num_kv_blocks=16, max_num_batched_tokens=9)
    assert_same_greedy(greedy(llm), baseline, "chunked+preemption")
    assert llm.engine.scheduler.num_preemptions > 0
    hits = llm.engine.stats().prefix_cache_hits
    assert_same_greedy(greedy(llm), baseline, "prefix-cached")
    assert llm.engine.stats().prefix_cache_hits > hits


@pytest.mark.parametrize("speculative", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "draft",
])
def test_speculation(model_dir, baseline, make_llm, checkpoint, speculative):
    if speculative == "draft":
        draft = checkpoint("llama", seed=7, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                           intermediate_size=64)
        speculative = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = make_llm(model_dir, kv_cache_dtype="int8", speculative_config=speculative)
    assert_same_greedy(greedy(llm), baseline, speculative["method"])
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    if speculative["method"] == "draft_model":
        assert all(kv.format == "int8" for kv in llm.engine.draft_proposer.kv_caches)


def test_kv_events_are_reported(model_dir):
    class Recorder:
        def __init__(self) -> None:
            self.stored: list[bytes] = []

        def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size) -> None:
            self.stored += block_hashes

        def blocks_removed(self, block_hashes) -> None: ...

        def all_blocks_cleared(self) -> None: ...

    recorder = Recorder()
    config = build_engine_config(str(model_dir), kv_cache_dtype="int8", num_kv_blocks=64, block_size=4)
    engine = LLMEngine(config, kv_events=recorder)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(recorder.stored) >= len(PROMPTS[0]) // 4


def test_tensor_parallel(model_dir, baseline, make_llm):
    """Each rank holds its KV heads' codes and scales."""
    with make_llm(model_dir, kv_cache_dtype="int8", tensor_parallel_size=2) as llm:
        assert [kv.k.shape[1] for kv in llm.engine.runner.kv_caches] == [1, 1]
        assert_same_greedy(greedy(llm), baseline, "TP=2")
