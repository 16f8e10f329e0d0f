"""The KV connector seam and the offloading connector's local tier, through the engine.

Every scenario runs twice, offloading off and on, on the same tiny seeded checkpoint and the same small KV pool,
and asserts greedy output equal token for token. The counters must then account for every loaded token: the
prompt tokens the engine computed dropped by exactly the tokens the tiers supplied (so a tier that never loads,
or loads and still recomputes, fails), and no KV block leaks (conftest checks every engine after each test).
Corrupt and mismatched blocks are refused, counted, and computed instead.
"""

from __future__ import annotations

import pytest
from kv_offload_fixtures import GREEDY, prompts, run_turns, tier, wait_for_saves

from pagoda import SamplingParams
from pagoda.block_hash import hash_block_chain
from pagoda.engine.kv_connector.block_format import encode_block, layout_of
from pagoda.engine.kv_connector.stores import LocalStore
from pagoda.entrypoints import build_engine_config
from pagoda.kv_transfer_config import KVTransferConfig

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 4
POOL = {"num_kv_blocks": 24, "block_size": BLOCK_SIZE, "max_model_len": 96}  # 96 tokens: two 40-token prompts evict
LOCAL = {"kv_offloading_size": 0.01}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("llama")


def returning_turns(seed: int = 0) -> list[list[int]]:
    """A 40-token conversation, three others that push it out of the pool, then the conversation's next turn."""
    first, *others = prompts(seed, 4, 40)
    return [first, *others, first + [7, 8, 9, 10, 11]]


def assert_loads_accounted(off, on, min_loaded: int) -> int:
    """Same local prefix hits in both; the prompt tokens computed differ by exactly what the tiers loaded."""
    off_stats, on_stats = off.engine.stats(), on.engine.stats()
    connector = on_stats.kv_connector
    assert connector is not None and off_stats.kv_connector is None
    loaded = connector.external_prefix_cache_hits
    assert loaded >= min_loaded
    assert on_stats.prefix_cache_hits == off_stats.prefix_cache_hits
    assert off_stats.prompt_tokens_computed - on_stats.prompt_tokens_computed == loaded
    assert sum(t.hit_tokens for t in connector.tiers) == loaded
    return loaded


def test_a_returning_turn_after_eviction_loads_its_prefix_and_outputs_the_same(model_dir, make_llm):
    turns = returning_turns()
    off, on = make_llm(model_dir, **POOL), make_llm(model_dir, **POOL, **LOCAL)
    assert run_turns(on, turns) == run_turns(off, turns)
    # 40 tokens = 10 blocks: all of them were evicted from the pool, all of them come back from the local tier.
    assert assert_loads_accounted(off, on, min_loaded=40) == 40
    local = tier(on, "CPU")
    assert (local.hit_blocks, local.refused_blocks, local.failures) == (10, 0, 0)
    assert local.bytes_loaded == 10 * on.engine.kv_connector.worker.layout.value_bytes
    assert local.blocks_saved > 0 and local.bytes_saved > 0


def test_without_eviction_the_local_prefix_cache_serves_and_nothing_is_loaded(model_dir, make_llm):
    first = prompts(1, 1, 40)[0]
    turns = [first, first + [1, 2, 3]]
    big = {**POOL, "num_kv_blocks": 256}
    off, on = make_llm(model_dir, **big), make_llm(model_dir, **big, **LOCAL)
    assert run_turns(on, turns) == run_turns(off, turns)
    assert on.engine.stats().prefix_cache_hits == 40
    assert assert_loads_accounted(off, on, min_loaded=0) == 0


def test_preempted_requests_come_back_through_the_tier_with_the_same_output(model_dir, make_llm):
    """Four requests in a pool that holds two: preemption, and recompute from the tier."""
    batch = prompts(2, 4, 30)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = {**POOL, "num_kv_blocks": 30, "max_model_len": 60}
    off, on = make_llm(model_dir, **options), make_llm(model_dir, **options, **LOCAL)
    expected = [list(out.outputs[0].token_ids) for out in off.generate(batch, params)]
    got = [list(out.outputs[0].token_ids) for out in on.generate(batch, params)]
    wait_for_saves(on)
    assert got == expected
    assert off.engine.stats().num_preemptions > 0 and on.engine.stats().num_preemptions > 0
    connector = on.engine.stats().kv_connector
    assert connector is not None and connector.external_prefix_cache_hits > 0
    assert sum(t.hit_tokens for t in connector.tiers) == connector.external_prefix_cache_hits


def _stored_key(llm, prompt: list[int], index: int) -> bytes:
    scheduler = llm.engine.kv_connector.scheduler
    return scheduler.namespace + hash_block_chain(prompt, BLOCK_SIZE)[index]


def test_a_corrupt_block_is_refused_and_computed_instead(model_dir, make_llm):
    turns = returning_turns(3)
    off, on = make_llm(model_dir, **POOL), make_llm(model_dir, **POOL, **LOCAL)
    expected = run_turns(off, turns)
    got = run_turns(on, turns[:-1])
    store = on.engine.kv_connector.worker.tiers[0]
    assert isinstance(store, LocalStore)
    store.corrupt(_stored_key(on, turns[0], 4), offset=-7)  # a byte of the fifth block's payload
    got += run_turns(on, turns[-1:])
    assert got == expected
    local = tier(on, "CPU")
    assert local.refused_blocks == 1
    assert local.hit_blocks == 4  # the blocks before it loaded; the rest were computed
    connector = on.engine.stats().kv_connector
    assert connector.failed_loads == 1 and connector.external_prefix_cache_hits == 16
    assert off.engine.stats().prompt_tokens_computed - on.engine.stats().prompt_tokens_computed == 16


def test_a_block_of_another_layout_is_refused_and_computed_instead(model_dir, make_llm):
    turns = returning_turns(4)
    off, on = make_llm(model_dir, **POOL), make_llm(model_dir, **POOL, **LOCAL)
    expected = run_turns(off, turns)
    got = run_turns(on, turns[:-1])
    worker = on.engine.kv_connector.worker
    ours = worker.layout
    # The same block in bfloat16 (as another engine's dtype would store it): a well-formed value, checksum right.
    other = layout_of([("bfloat16", spec.shape, spec.num_bytes // 2) for spec in ours.tensors])
    worker.tiers[0].put(_stored_key(on, turns[0], 0), encode_block(other, bytes(other.payload_bytes)))
    got += run_turns(on, turns[-1:])
    assert got == expected
    local = tier(on, "CPU")
    assert (local.refused_blocks, local.hit_blocks) == (1, 0)
    assert on.engine.stats().kv_connector.external_prefix_cache_hits == 0
    assert on.engine.stats().prompt_tokens_computed == off.engine.stats().prompt_tokens_computed


def test_a_local_tier_smaller_than_the_history_keeps_the_latest_blocks_and_stays_exact(model_dir, make_llm):
    turns = returning_turns(5)
    off = make_llm(model_dir, **POOL)
    expected = run_turns(off, turns)
    probe = make_llm(model_dir, **POOL, **LOCAL)
    layout_bytes = probe.engine.kv_connector.worker.layout.value_bytes
    probe.close()
    # Room for 12 blocks: the three later prompts (30 blocks) evict the first one's from the tier too.
    small = {"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                    "kv_connector_extra_config": {"cpu_bytes_to_use": 12 * layout_bytes}}}
    on = make_llm(model_dir, **POOL, **small)
    assert run_turns(on, turns) == expected
    assert len(on.engine.kv_connector.worker.tiers[0]) == 12
    assert_loads_accounted(off, on, min_loaded=0)


def test_multi_connector_loads_from_the_first_that_has_the_tokens_and_saves_to_all(model_dir, make_llm):
    turns = returning_turns(6)
    child = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22}}
    multi = {"kv_transfer_config": {"kv_connector": "MultiConnector",
                                    "kv_connector_extra_config": {"connectors": [child, child]}}}
    off, on = make_llm(model_dir, **POOL), make_llm(model_dir, **POOL, **multi)
    assert run_turns(on, turns) == run_turns(off, turns)
    first, second = on.engine.stats().kv_connector.tiers
    assert first.blocks_saved == second.blocks_saved > 0
    assert (first.hit_blocks, second.hit_blocks) == (10, 0)
    assert_loads_accounted(off, on, min_loaded=40)


def test_a_consumer_only_loads_and_a_producer_only_saves(model_dir, make_llm):
    turns = returning_turns(7)
    for role, saves in (("kv_consumer", False), ("kv_producer", True)):
        config = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": role,
                                         "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22}}}
        llm = make_llm(model_dir, **POOL, **config)
        run_turns(llm, turns)
        stats = tier(llm, "CPU")
        assert (stats.blocks_saved > 0) == saves and stats.hit_blocks == 0
        llm.close()


def test_prompt_logprobs_requests_compute_their_whole_prompt(model_dir, make_llm):
    turns = returning_turns(8)
    on = make_llm(model_dir, **POOL, **LOCAL)
    run_turns(on, turns[:-1])
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = on.generate([turns[-1]], with_logprobs)[0]
    assert len(out.prompt_logprobs) == len(turns[-1])
    assert on.engine.stats().kv_connector.external_prefix_cache_hits == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"}}, "is not built"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "needs a tier"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                             "kv_connector_extra_config": {"num_cpu_blocks": 8}}}, "num_cpu_blocks"),
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_buffer": 1}},
     "kv_buffer"),
    ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, "lmcache"),
    ({"kv_offloading_backend": "native"}, "needs kv_offloading_size"),
    ({"kv_offloading_size": 1.0, "kv_transfer_config": {"kv_connector": "OffloadingConnector"}}, "not both"),
    ({"kv_transfer_config": {"kv_connector": "MultiConnector"}}, "connectors"),
])
def test_connector_configs_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config("model", **options)


def test_the_offloading_shorthand_is_an_offloading_connector_of_that_size():
    config = build_engine_config("model", kv_offloading_size=2, kv_offloading_backend="native")
    assert config.kv_transfer_config == KVTransferConfig(
        "OffloadingConnector", "kv_both", {"cpu_bytes_to_use": 2 << 30})


class MediumSink:
    """Records KV events as (kind, medium, block hashes)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[bytes]]] = []

    def blocks_stored(self, block_hashes, parent_hash, token_ids, block_size, medium="GPU") -> None:
        self.events.append(("stored", medium, list(block_hashes)))

    def blocks_removed(self, block_hashes, medium="GPU") -> None:
        self.events.append(("removed", medium, list(block_hashes)))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared", "GPU", []))

    def blocks(self, kind: str, medium: str) -> list[bytes]:
        return [h for k, m, hashes in self.events if (k, m) == (kind, medium) for h in hashes]


def test_offloaded_blocks_are_reported_with_their_medium(model_dir):
    from conftest import register_engine

    from pagoda.engine.engine import LLMEngine

    sink = MediumSink()
    probe_bytes = 4 << 10  # about two blocks of this model: the tier evicts as it fills
    config = build_engine_config(str(model_dir), **POOL, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": probe_bytes}})
    engine = LLMEngine(config, kv_events=sink)
    register_engine(engine)
    slots = engine.kv_connector.worker.tiers[0].num_slots
    assert 0 < slots < 10
    prompt = prompts(9, 1, 40)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_connector.worker.wait_for_saves()
    chain = hash_block_chain(prompt, BLOCK_SIZE)
    assert sink.blocks("stored", "GPU") == chain
    assert sink.blocks("stored", "CPU") == chain, "every full block went down to the local tier"
    evicted = sink.blocks("removed", "CPU")
    assert evicted == chain[: len(chain) - slots], "the tier's LRU evicted the oldest, and said so"
    assert engine.stats().kv_connector.tiers[0].evicted_blocks == len(evicted)
    engine.shutdown()


def test_the_counters_reach_prometheus_text(model_dir, make_llm):
    from pagoda.server.metrics import ServerMetrics

    turns = returning_turns(10)
    on = make_llm(model_dir, **POOL, **LOCAL)
    run_turns(on, turns)
    text = ServerMetrics("m", on.engine.stats).render().decode()
    stats = on.engine.stats()
    connector, local = stats.kv_connector, tier(on, "CPU")
    assert local.hit_tokens == 40
    for line in (
        f'vllm:external_prefix_cache_hits_total{{model_name="m"}} {float(connector.external_prefix_cache_hits)}',
        f'vllm:external_prefix_cache_queries_total{{model_name="m"}} {float(connector.external_prefix_cache_queries)}',
        f'vllm:kv_offload_total_bytes_total{{model_name="m",transfer_type="CPU_to_GPU"}} {float(local.bytes_loaded)}',
        f'vllm:kv_offload_total_bytes_total{{model_name="m",transfer_type="GPU_to_CPU"}} {float(local.bytes_saved)}',
        'pagoda:kv_offload_hit_tokens_total{medium="CPU",model_name="m"} 40.0',
        'pagoda:kv_offload_refused_blocks_total{medium="CPU",model_name="m"} 0.0',
        f'pagoda:prompt_tokens_computed_total{{model_name="m"}} {float(stats.prompt_tokens_computed)}',
    ):
        assert line in text, line


def test_an_adapters_blocks_and_the_bases_never_load_for_each_other(model_dir, make_llm, tmp_path):
    """LoRA adapters key their blocks apart from the base's (the adapter is in the chained hash), and so do the
    offload tiers: a conversation offloaded on the base is not loaded for an adapter request, and comes back for
    the same adapter, with the output of that adapter computed from scratch."""
    from lora_fixtures import make_adapter

    from pagoda import LoRARequest

    adapter = LoRARequest("tuned", 1, str(make_adapter(model_dir, tmp_path / "tuned", r=4, alpha=8,
                                                       targets=["q_proj", "v_proj"], seed=3, scale=4.0)))
    first, *others = prompts(5, 4, 40)
    options = {**POOL, **LOCAL, "enable_lora": True, "max_lora_rank": 8}
    on = make_llm(model_dir, **options)
    plain = make_llm(model_dir, **POOL, enable_lora=True, max_lora_rank=8)

    def turn(llm, prompt: list[int], lora: LoRARequest | None) -> list[int]:
        tokens = list(llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids)
        wait_for_saves(llm)
        return tokens

    base_then = turn(on, first, None)
    for other in others:  # push the base's blocks out of the pool, down to the tier
        turn(on, other, None)
    loaded_before = on.engine.stats().kv_connector.external_prefix_cache_hits
    assert turn(on, first, adapter) == turn(plain, first, adapter) != base_then
    assert on.engine.stats().kv_connector.external_prefix_cache_hits == loaded_before, "base blocks for an adapter"
    for other in others:  # and the adapter's out (these come back from the tier themselves)
        turn(on, other, None)
    loaded_before = on.engine.stats().kv_connector.external_prefix_cache_hits
    assert turn(on, first + [7, 8], adapter) == turn(plain, first + [7, 8], adapter)
    assert on.engine.stats().kv_connector.external_prefix_cache_hits == loaded_before + 40  # the adapter's own


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_offloads_codes_and_scales_together(model_dir, make_llm, kv_cache_dtype):
    """A quantized cache's blocks go down a tier and come back whole (int8's per-token scales beside its codes):
    the returning turn's output equals the same quantized engine's without offloading, every token loaded."""
    turns = returning_turns(3)
    quantized = {**POOL, "kv_cache_dtype": kv_cache_dtype}
    off, on = make_llm(model_dir, **quantized), make_llm(model_dir, **quantized, **LOCAL)
    assert run_turns(on, turns) == run_turns(off, turns)
    assert assert_loads_accounted(off, on, min_loaded=40) == 40
    layout = on.engine.kv_connector.worker.layout
    assert len(layout.tensors) == (4 if kv_cache_dtype == "int8" else 2) * on.engine.model_config.num_layers


def test_a_kv_connector_is_refused_with_calculated_kv_scales(model_dir):
    from pagoda import LLM
    from pagoda.model_dir import ModelLoadError

    with pytest.raises(ModelLoadError, match="calculate_kv_scales"):
        LLM(str(model_dir), kv_cache_dtype="fp8", calculate_kv_scales=True, **LOCAL)
