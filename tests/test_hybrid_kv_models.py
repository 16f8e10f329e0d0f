"""The hybrid KV layout on real models (Gemma 2, Gemma 3, a Mistral-shaped model, Qwen2 with sliding layers): the
engine picks it for a window shorter than the context, each sliding group holds at most its window's blocks as a
long sequence decodes while the full groups hold every block (counted at every step), the greedy tokens stay
transformers', and every block returns to the pool. Greedy equality under batching, chunked prefill, preemption
and prefix hits is tests/test_correctness.py's, over the same models."""

from __future__ import annotations

import math

import pytest
from conftest import compare_with_reference, random_prompts
from kv_offload_fixtures import run_turns, tier
from test_correctness import MAX_NEW_TOKENS, PROMPTS, SLIDING_WINDOW, observe_schedules, run_greedy
from test_tensor_parallel import MODES

from pagoda import SamplingParams
from pagoda.calc.deployment import CalcInputs, derive
from pagoda.calc.presets import resolve_gpu
from pagoda.calc.shapes import shape_from_hf_config, shape_from_path
from pagoda.engine.core.hybrid_kv_cache import HybridKVCacheManager
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.kv_groups import window_blocks
from pagoda.model.loader import load_model_config
from pagoda.startup import startup_summary

BLOCK_SIZE = 4
LONG_PROMPT = random_prompts([30], seed=7)[0]
NEW_TOKENS = 70  # 100 tokens: four windows of 24


@pytest.mark.parametrize(("arch", "num_groups"), [("gemma2", 2), ("gemma3", 3), ("mistral", 1), ("qwen2-swa", 2)])
def test_a_long_sequence_holds_only_its_window_in_sliding_groups(arch, num_groups, checkpoint, hf_reference,
                                                               make_llm, monkeypatch):
    model_dir = checkpoint(arch)
    llm = make_llm(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=256, max_num_batched_tokens=8)
    kv_cache = llm.engine.kv_cache
    assert isinstance(kv_cache, HybridKVCacheManager) and len(kv_cache.groups) == num_groups
    # Layer i of every group shares the pool's tensor i: as many tensors as a group has layers.
    kv_caches = llm.engine.runner.kv_caches
    assert len({id(cache) for cache in kv_caches}) == len(kv_cache.groups[0].layers)

    held: list[tuple[int, list[int], int]] = []  # per step: (computed tokens, blocks per group, free blocks)
    scheduler = llm.engine.scheduler
    original_update = scheduler.update

    def update(output, runner_output):
        for item in output.scheduled:  # as the step ran: before update moves the counts on
            request = item.request
            held.append((request.num_computed_tokens + item.num_tokens, kv_cache.blocks_held(request.request_id),
                         kv_cache.num_free_blocks))
        return original_update(output, runner_output)

    monkeypatch.setattr(scheduler, "update", update)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = llm.generate([LONG_PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    compare_with_reference(tokens, hf_reference(model_dir, LONG_PROMPT, NEW_TOKENS), f"{arch}/long")

    decode_bound = math.ceil(SLIDING_WINDOW / BLOCK_SIZE) + 1
    chunk_bound = window_blocks(SLIDING_WINDOW, BLOCK_SIZE, chunk=8)
    assert len(held) >= NEW_TOKENS
    for num_slots, per_group, free in held:
        for group, count in zip(kv_cache.groups, per_group):
            if group.window is None:
                assert count == math.ceil(num_slots / BLOCK_SIZE)
            else:  # a prefill chunk sees the window before it too; a decode its window alone
                assert count <= (decode_bound if num_slots > len(LONG_PROMPT) else chunk_bound)
        # The pool's free count: what the groups hold, where one table over every layer would hold a block
        # of every layer for each of the sequence's blocks.
        assert free == 256 - sum(per_group)
    last_slots, last_groups, _ = held[-1]
    sliding = [count for group, count in zip(kv_cache.groups, last_groups) if group.window is not None]
    assert sliding and max(sliding) <= decode_bound < math.ceil(last_slots / BLOCK_SIZE)
    assert kv_cache.num_free_blocks == 256  # and the conftest checks every block's accounting


def test_a_window_as_long_as_the_context_keeps_one_table(checkpoint, make_llm):
    """A window no shorter than max_model_len excludes nothing: the single-table manager, as before."""
    llm = make_llm(checkpoint("mistral"), block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=SLIDING_WINDOW)
    assert type(llm.engine.kv_cache) is KVCacheManager


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral", "qwen2-swa", "phi3", "llama"])
def test_the_calculator_reads_each_layers_window_as_the_engine_does(arch, checkpoint):
    model_dir = checkpoint(arch)
    engine_windows = load_model_config(model_dir).sliding_windows
    calc_windows = shape_from_path(model_dir).architecture.sliding_windows
    assert calc_windows == (engine_windows if any(w is not None for w in engine_windows) else ())


def test_the_calculators_kv_per_sequence_keeps_only_the_windows_of_sliding_layers():
    """Gemma 2's shape (alternating 4096-token windows): a 32K-token sequence keeps 32K tokens in the global
    layers and 4K in the local ones, 18K a layer on average."""
    config = {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "num_hidden_layers": 26,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
              "sliding_window": 4096}
    windowed = shape_from_hf_config(config, "gemma-2-2b")
    full = shape_from_hf_config({**config, "sliding_window": None}, "gemma-2-2b")
    assert windowed.architecture.sliding_windows == (4096, None) * 13
    gpu = resolve_gpu("h100-sxm")
    with_windows = derive(CalcInputs(windowed, gpu, seq_len=32768))
    without = derive(CalcInputs(full, gpu, seq_len=32768))
    assert with_windows.kv_tokens_per_sequence == (32768 + 4096) / 2
    assert with_windows.kv_bytes_per_sequence == pytest.approx(without.kv_bytes_per_sequence * 18432 / 32768)
    assert with_windows.max_sequences > without.max_sequences


def test_the_start_up_summary_counts_sequences_with_the_windows(checkpoint, make_llm):
    llm = make_llm(checkpoint("gemma2"), block_size=BLOCK_SIZE, num_kv_blocks=200, max_model_len=100)
    engine = llm.engine
    summary = startup_summary(engine.describe(), engine.config, "gemma2")
    # 25 blocks of the full group and ceil(23 / 4) + 1 = 7 of the sliding one: 200 // 32 = 6 sequences, where the
    # same bytes as one table over both layers (100 blocks of 25 a sequence) would hold 4.
    assert ("200 blocks x 4 tokens of one group's layers, 1 full + 1 sliding-window (24) groups of 1 layers: "
            "6 sequences of max_model_len at once") in summary


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_kv_offloading_keeps_one_table_and_loads_a_returning_turn_exactly(tensor_parallel_size, checkpoint,
                                                                          hf_reference, make_llm):
    """The offloading connector saves and loads a block of every layer through one table (and under tensor
    parallelism each rank its share of it): a sliding-window model runs it on one table over every layer, its
    output transformers' and a returning turn's prefix loaded from the CPU tier after eviction."""
    model_dir = checkpoint("gemma2")
    first, *others = random_prompts([40, 40, 40], seed=11)
    turns = [first, *others, first + [7, 8, 9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with make_llm(model_dir, num_kv_blocks=24, block_size=BLOCK_SIZE, max_model_len=96, kv_offloading_size=0.01,
                  tensor_parallel_size=tensor_parallel_size) as llm:
        assert type(llm.engine.kv_cache) is KVCacheManager
        outputs = run_turns(llm, turns, params)
        loaded = tier(llm, "CPU").hit_tokens
    for index, (prompt, tokens) in enumerate(zip(turns, outputs)):
        compare_with_reference(tokens, hf_reference(model_dir, prompt, 6), f"gemma2/offloaded/tp{tensor_parallel_size}"
                               f"/turn{index}")
    assert loaded >= 36  # the returning turn's first 9 blocks came back from the tier, not the (evicted) pool


def test_static_batching_on_per_group_tables_waits_for_the_batch_and_stays_exact(checkpoint, hf_reference,
                                                                                 make_llm, monkeypatch):
    """The static-batching gate over a hybrid pool: the second batch starts only once the whole first one has
    finished (its short answer's slot idles), and every answer is transformers'."""
    model_dir = checkpoint("gemma2")
    prompts = random_prompts([30, 12, 26, 9], seed=5)
    lengths = [40, 4, 40, 4]
    llm = make_llm(model_dir, block_size=BLOCK_SIZE, num_kv_blocks=96, max_num_seqs=2, batching="static")
    assert isinstance(llm.engine.kv_cache, HybridKVCacheManager)
    steps = observe_schedules(monkeypatch, llm.engine.scheduler)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for index, (prompt, output, length) in enumerate(zip(prompts, outputs, lengths)):
        compare_with_reference(output.outputs[0].token_ids, hf_reference(model_dir, prompt, length),
                               f"gemma2/static/{index}")
    # Each step's requests, by prompt length: the batches never mix, and the first ends with prompt 0 alone.
    batches = [{num_prompt for _, _, num_prompt in step} for step in steps]
    first, second = {30, 12}, {26, 9}
    assert all(batch <= first or batch <= second for batch in batches)
    last_of_first = max(i for i, batch in enumerate(batches) if batch <= first)
    assert batches[last_of_first - 1] == {30} and all(batch <= second for batch in batches[last_of_first + 1:])


@pytest.mark.timeout(300)
def test_expert_parallel_ranks_run_a_sliding_mixture_of_experts_on_its_groups_tables(checkpoint, hf_reference,
                                                                                     make_llm, monkeypatch):
    """Mixtral with a sliding window on every layer, experts split over two ranks: each rank's KV cache takes the
    engine's groups (one sliding group), blocks out of the window return to the pool under chunked prefill and
    preemption, and the output is transformers'."""
    model_dir = checkpoint("mixtral", sliding_window=SLIDING_WINDOW)
    references = [hf_reference(model_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    with make_llm(model_dir, tensor_parallel_size=2, enable_expert_parallel=True, **MODES["chunked+preemption"]
                  ) as llm:
        kv_cache = llm.engine.kv_cache
        assert isinstance(kv_cache, HybridKVCacheManager) and [g.window for g in kv_cache.groups] == [SLIDING_WINDOW]
        original_free = kv_cache.free
        dropped: list[int] = []  # the window's dropped places in each request's table as it leaves

        def free(request, *args):
            dropped.append(sum(1 for block_id in request.block_tables[0] if block_id < 0))
            return original_free(request, *args)

        monkeypatch.setattr(kv_cache, "free", free)
        outputs = run_greedy(llm, PROMPTS)
        assert llm.engine.scheduler.num_preemptions > 0
    for index, (tokens, reference) in enumerate(zip(outputs, references)):
        compare_with_reference(tokens, reference, f"mixtral-swa/ep2/prompt {index}")
    assert max(dropped) > 0  # some request outgrew its window and gave those blocks back
