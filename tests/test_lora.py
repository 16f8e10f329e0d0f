"""LoRA adapters, batched: greedy fp32 output of every adapter in a mixed batch (several adapters and the base
model together, different ranks and target modules, one rsLoRA) equals transformers + PEFT on that adapter token
for token, on every dense family (Phi-3's fused projections: test_lora_phi3.py), under chunked prefill,
preemption and prefix caching; the prefix cache never crosses adapters; the scheduler bounds a step's adapters by
max_loras; the native decode stack runs adapter rows as the modules do. Divergence is allowed only at a near-tie
(conftest.compare_with_reference)."""

from __future__ import annotations

import shutil

import pytest
from conftest import compare_with_reference, random_prompts
from lora_fixtures import make_adapter, peft_reference
from test_native_decode import CountingStack

from pagoda import LoRARequest, SamplingParams
from pagoda.kernels import available_targets

MAX_NEW_TOKENS = 12
PROMPTS = random_prompts([1, 6, 13, 22, 31, 40], seed=3)
PROMPTS.append(PROMPTS[-1][:28] + random_prompts([7], seed=4)[0])  # shares a 28-token prefix with the one before
# name -> (rank, alpha, target modules, rsLoRA, other LoraConfig fields): different ranks and module sets, one
# rsLoRA, one on the last layer only.
ADAPTERS = {
    "attn": (8, 16, ("q_proj", "v_proj", "o_proj"), False, {"layers_to_transform": [1]}),
    "mlp": (4, 8, ("gate_proj", "up_proj", "down_proj"), True, {}),
    "all": (16, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False, {}),
}
MODES = {
    "all-at-once": dict(block_size=16, num_kv_blocks=128),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=16),
    "prefix-cached": dict(block_size=4, num_kv_blocks=256),
    # n-gram drafts (n = 1: some are proposed on these prompts), each checked as a one-token decode row.
    "speculative": dict(block_size=4, num_kv_blocks=256,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1}),
}
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2"]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """adapters(arch) -> {name: adapter directory}, made once per architecture."""
    made: dict[str, dict[str, str]] = {}

    def get(arch: str) -> dict[str, str]:
        if arch not in made:
            base = checkpoint(arch)
            made[arch] = {
                name: str(make_adapter(base, tmp_path_factory.mktemp(f"{arch}-{name}"), r=r, alpha=alpha,
                                       targets=targets, rslora=rslora, seed=index + 1, **fields))
                for index, (name, (r, alpha, targets, rslora, fields)) in enumerate(ADAPTERS.items())
            }
        return made[arch]

    return get


def greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def mixed_requests(paths: dict[str, str]) -> list[LoRARequest | None]:
    """One per prompt, round robin over the base model and each adapter."""
    choices: list[LoRARequest | None] = [None] + [LoRARequest(name, index + 1, path)
                                                   for index, (name, path) in enumerate(paths.items())]
    return [choices[index % len(choices)] for index in range(len(PROMPTS))]


def check_against_peft(base, paths, requests, outputs, label):
    for index, (request, output) in enumerate(zip(requests, outputs)):
        adapter_dir = None if request is None else paths[request.lora_name]
        reference = peft_reference(base, adapter_dir, PROMPTS[index], MAX_NEW_TOKENS)
        name = "base" if request is None else request.lora_name
        compare_with_reference(output.outputs[0].token_ids, reference, f"{label}/prompt {index} ({name})")


@pytest.mark.parametrize("arch", ARCHS)
def test_each_adapter_changes_the_output(arch, checkpoint, adapters):
    """The adapters are not no-ops (init_lora_weights=False): each one's PEFT output differs from the base's."""
    base = checkpoint(arch)
    for name, path in adapters(arch).items():
        changed = [peft_reference(base, path, prompt, MAX_NEW_TOKENS).token_ids
                   != peft_reference(base, None, prompt, MAX_NEW_TOKENS).token_ids for prompt in PROMPTS]
        assert sum(changed) >= len(PROMPTS) - 1, f"{arch}/{name} leaves the output as the base model's"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_peft(arch, mode, checkpoint, adapters, make_llm):
    base, paths = checkpoint(arch), adapters(arch)
    options = dict(MODES[mode])
    if arch in ("gemma2", "gemma3") and mode == "preemption":  # two KV groups share the pool: thrice the blocks
        options["num_kv_blocks"] = 3 * options["num_kv_blocks"]
    llm = make_llm(base, enable_lora=True, max_loras=3, max_cpu_loras=3, **options)
    requests = mixed_requests(paths)
    if mode == "prefix-cached":
        llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    hits_before = llm.engine.scheduler.prefix_cache_hits
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    check_against_peft(base, paths, requests, outputs, f"{arch}/{mode}")
    scheduler = llm.engine.scheduler
    if mode == "preemption":
        assert scheduler.num_preemptions > 0
    if mode == "speculative":
        assert scheduler.spec_decode.num_drafts > 0
    if mode == "prefix-cached":
        assert all(o.num_cached_tokens == (len(p) - 1) // 4 * 4 for o, p in zip(outputs, PROMPTS)), \
            "each request should hit its own earlier run's blocks, adapter or base"
        assert scheduler.prefix_cache_hits > hits_before


def test_one_adapter_per_step_under_max_loras_1(checkpoint, adapters, make_llm, monkeypatch):
    """max_loras=1 (vLLM's default): no step holds two adapters, adapter requests wait their turn, and every
    output is still PEFT's."""
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True, max_cpu_loras=2)
    scheduler = llm.engine.scheduler
    per_step: list[set[str]] = []
    waited = []
    original = scheduler.schedule

    def schedule():
        output = original()
        per_step.append({s.request.lora.name for s in output.scheduled if s.request.lora is not None})
        waited.append(any(r.lora is not None for r in scheduler.waiting))
        return output

    monkeypatch.setattr(scheduler, "schedule", schedule)
    requests = mixed_requests(paths)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    check_against_peft(base, paths, requests, outputs, "max_loras=1")
    assert max(len(names) for names in per_step) == 1
    assert set().union(*per_step) == set(ADAPTERS)
    assert any(waited), "an adapter request should have waited for another adapter to drain"
    # max_cpu_loras=2 of 3 adapters: one was dropped from memory and read again from its directory
    assert len(llm.engine.lora.loaded()) == 2


def test_an_adapter_never_gets_the_base_models_blocks(checkpoint, adapters, make_llm):
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True)
    prompt = PROMPTS[-2]  # 40 tokens: 9 full blocks of 4 a hit could cover
    scheduler = llm.engine.scheduler
    llm.generate([prompt], greedy(), use_tqdm=False)
    hits = scheduler.prefix_cache_hits
    attn = LoRARequest("attn", 1, paths["attn"])
    [first] = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=attn)
    assert first.num_cached_tokens == 0 and scheduler.prefix_cache_hits == hits, "an adapter got base blocks"
    [second] = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=attn)
    assert second.num_cached_tokens == 36, "two requests on the same adapter should share blocks"
    mlp = LoRARequest("mlp", 2, paths["mlp"])
    [other] = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=mlp)
    assert other.num_cached_tokens == 0, "an adapter got another adapter's blocks"
    [again] = llm.generate([prompt], greedy(), use_tqdm=False)
    assert again.num_cached_tokens == 36, "the base model's own blocks are still its"
    for output, path in ((first, paths["attn"]), (second, paths["attn"]), (other, paths["mlp"]), (again, None)):
        compare_with_reference(output.outputs[0].token_ids, peft_reference(base, path, prompt, MAX_NEW_TOKENS))


def test_a_name_reloaded_with_new_weights_never_serves_its_old_blocks(checkpoint, adapters, make_llm, tmp_path):
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True)
    prompt = PROMPTS[-2]
    directory = tmp_path / "adapter"
    shutil.copytree(paths["attn"], directory)
    request = LoRARequest("tuned", 1, str(directory))
    [old] = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=request)
    compare_with_reference(old.outputs[0].token_ids, peft_reference(base, paths["attn"], prompt, MAX_NEW_TOKENS))
    # The same name and path, the files rewritten with other weights (a newer checkpoint of the adapter).
    shutil.rmtree(directory)
    shutil.copytree(paths["all"], directory)
    [new] = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=request)
    assert new.num_cached_tokens == 0, "the reloaded adapter was served its old weights' blocks"
    compare_with_reference(new.outputs[0].token_ids, peft_reference(base, paths["all"], prompt, MAX_NEW_TOKENS))
    # The same name under another path: another generation again.
    [moved] = llm.generate([prompt], greedy(), use_tqdm=False,
                           lora_request=LoRARequest("tuned", 1, paths["mlp"]))
    assert moved.num_cached_tokens == 0
    compare_with_reference(moved.outputs[0].token_ids, peft_reference(base, paths["mlp"], prompt, MAX_NEW_TOKENS))
    assert [a.generation for a in llm.engine.lora.loaded()] == [2]  # max_cpu_loras defaults to max_loras, 1


def test_removing_an_adapter_frees_its_weights_but_not_a_running_requests(checkpoint, adapters, make_llm):
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True, max_loras=2, max_cpu_loras=2)
    engine = llm.engine
    for index, name in enumerate(("attn", "mlp"), 1):
        engine.add_lora(LoRARequest(name, index, paths[name]))
    engine.add_request("busy", PROMPTS[0], greedy(), lora_request=LoRARequest("mlp", 2, paths["mlp"]))
    engine.remove_lora("attn")
    engine.remove_lora("mlp")  # its request is waiting: its weights stay
    assert [a.name for a in engine.lora.loaded()] == ["mlp"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("mlp")
    assert engine.lora.loaded() == []


@pytest.mark.skipif(not available_targets(), reason="this CPU has neither AVX2 + FMA nor AVX-512")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_stack_runs_adapter_rows_as_the_modules_do(dtype, checkpoint, adapters, make_llm):
    """Decode steps with adapter rows (several adapters and the base in one batch) run in the native stack, and
    give the modules' output bit for bit: tokens and logprobs. Steps of the base alone run it too."""
    base, paths = checkpoint("llama"), adapters("llama")
    requests = mixed_requests(paths)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=3)
    results, counter = {}, None
    for native in (True, False):
        llm = make_llm(base, enable_lora=True, max_loras=3, dtype=dtype)
        backend = llm.engine.model.backend
        assert backend.decode_runner is not None, "the native decode stack should be bound"
        if native:
            counter = backend.decode_runner.inner.stack = CountingStack(backend.decode_runner.inner.stack)
        else:
            backend.decode_runner = None
        outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=requests)
        results[native] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        if native:
            [plain] = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False)
            compare_with_reference(plain.outputs[0].token_ids,
                                   peft_reference(base, None, PROMPTS[2], MAX_NEW_TOKENS), "base alone")
    assert counter is not None and counter.lora_calls >= MAX_NEW_TOKENS - 1, "adapter rows skipped the native stack"
    assert counter.calls >= MAX_NEW_TOKENS - 1, "base-only decode steps should run the native stack"
    assert results[True] == results[False]


@pytest.mark.parametrize("config", [{"dtype": "bfloat16"}, {"dtype": "bfloat16", "quantization": "int8"}])
def test_low_precision_bases_take_adapters(config, checkpoint, adapters, make_llm):
    """bf16 and int8 bases: adapters apply (the output follows the adapter, not the base), and a base row beside
    adapter rows starts as the base model's own output in that precision (later tokens may differ: low-precision
    sums depend on the batch, and base-only steps run the native decode stack)."""
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True, max_loras=2, **config)
    prompts = PROMPTS[1:5]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    requests = [None, LoRARequest("all", 1, paths["all"]), None, LoRARequest("mlp", 2, paths["mlp"])]
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False, lora_request=requests)]
    assert mixed[0][:3] == plain[0][:3] and mixed[2][:3] == plain[2][:3]
    for index in (1, 3):
        adapter_dir = paths[requests[index].lora_name]
        reference = peft_reference(base, adapter_dir, prompts[index], MAX_NEW_TOKENS).token_ids
        assert mixed[index] != plain[index]
        assert mixed[index][:3] == reference[:3], "the adapter's first tokens should be the fp32 reference's"


def test_the_adapter_enters_the_first_blocks_hash_and_base_hashes_are_unchanged():
    from pagoda.block_hash import ROOT_SEED, hash_block
    from pagoda.engine.core.lora import AdapterId

    tokens = [11, 12, 13, 14]
    base = hash_block(None, tokens)
    assert base == hash_block(None, tokens, None, None), "no adapter: the hash the router computes"
    first, reloaded = AdapterId("a", 0).key, AdapterId("a", 1).key
    assert len({base, hash_block(None, tokens, None, first), hash_block(None, tokens, None, reloaded)}) == 3
    # Neither a salt nor an adapter name can spell another's key: the adapter's is length-prefixed.
    assert hash_block(None, tokens, "b", first) != hash_block(None, tokens, None, AdapterId("ab", 0).key)
    assert hash_block(None, tokens, f"lora:{first}") != hash_block(None, tokens, None, first)
    assert hash_block(base, tokens, None, first) == hash_block(base, tokens), "later blocks chain the first's hash"
    assert ROOT_SEED == b"pagoda-root"


def test_running_requests_pin_their_adapters():
    from pagoda.engine.core.lora import AdapterId, adapter_fits

    a, b, a_reloaded = AdapterId("a", 0), AdapterId("b", 0), AdapterId("a", 1)
    assert adapter_fits(None, [a], 1), "the base model takes no slot"
    assert adapter_fits(a, [a, None, a], 1)
    assert not adapter_fits(b, [a, None], 1)
    assert not adapter_fits(a_reloaded, [a], 1), "a reloaded name is another adapter"
    assert adapter_fits(b, [a], 2) and adapter_fits(b, [None], 1)
    assert adapter_fits(b, [a], None), "no bound without LoRA"


def test_parallel_samples_and_prompt_logprobs_on_an_adapter(checkpoint, adapters, make_llm):
    """n samples of one adapter request all run on it (the deferred ones too); prompt logprobs are its own."""
    base, paths = checkpoint("llama"), adapters("llama")
    llm = make_llm(base, enable_lora=True)
    request = LoRARequest("mlp", 1, paths["mlp"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, n=2, prompt_logprobs=0)
    [output] = llm.generate([PROMPTS[3]], params, use_tqdm=False, lora_request=request)
    reference = peft_reference(base, paths["mlp"], PROMPTS[3], MAX_NEW_TOKENS)
    for sample in output.outputs:
        compare_with_reference(sample.token_ids, reference, "n=2 on an adapter")
    [plain] = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert output.prompt_logprobs[1:] != plain.prompt_logprobs[1:], "prompt logprobs should be the adapter's"


def test_a_draft_model_speculates_for_adapter_requests_without_the_adapter(checkpoint, adapters, make_llm):
    """The draft model (here the base itself) proposes without the adapter, and the target verifies with it: every
    request's greedy output is still its own adapter's PEFT output. The base's requests accept every draft; the
    adapters' accept fewer, since their drafts come from the base model."""
    base, paths = checkpoint("llama"), adapters("llama")
    spec = {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3}
    requests = mixed_requests(paths)
    llm = make_llm(base, enable_lora=True, max_loras=3, speculative_config=spec)
    check_against_peft(base, paths, requests, llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests),
                       "draft model")
    rates = {}
    for label, request in (("base", None), ("adapter", LoRARequest("all", 3, paths["all"]))):
        llm = make_llm(base, enable_lora=True, speculative_config=spec)
        llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=[request] * len(PROMPTS))
        stats = llm.engine.stats().spec_decode
        assert stats is not None and stats.num_draft_tokens > 0
        rates[label] = stats.num_accepted_tokens / stats.num_draft_tokens
    assert rates["base"] == 1.0 and rates["adapter"] < 1.0, rates
