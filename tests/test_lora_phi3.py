"""LoRA on Phi-3, whose checkpoint fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: PEFT targets
those as whole modules, and pagoda adds their deltas across the fused outputs it splits the checkpoint into.
The tiny Phi-3 has partial rotary, whose q/k row reordering at load the adapters' rows follow. Greedy fp32 output
of a mixed batch (the base model and two adapters) equals transformers + PEFT token for token, batched and with
chunked prefill; adapters in the other layout are refused by name. Divergence only at a near-tie
(conftest.compare_with_reference)."""

from __future__ import annotations

import pytest
from lora_fixtures import make_adapter, peft_reference
from test_lora import MAX_NEW_TOKENS, PROMPTS, check_against_peft, greedy, mixed_requests
from test_lora_errors import edited

from pagoda import LoRARequest, SamplingParams
from pagoda.engine.api import RequestRejected

# name -> (rank, alpha, PEFT target modules, rsLoRA, other LoraConfig fields)
ADAPTERS = {
    "fused": (8, 16, ("qkv_proj", "gate_up_proj"), False, {}),
    "all": (4, 8, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), True, {"layers_to_transform": [1]}),
}
MODES = {
    "batched": dict(block_size=16, num_kv_blocks=128),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=7),
}


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("phi3")


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory):
    return {name: str(make_adapter(base, tmp_path_factory.mktemp(f"phi3-{name}"), r=r, alpha=alpha, targets=targets,
                                   rslora=rslora, seed=index + 1, scale=4.0, **fields))
            for index, (name, (r, alpha, targets, rslora, fields)) in enumerate(ADAPTERS.items())}


def test_each_adapter_changes_the_output(base, paths):
    for name, path in paths.items():
        changed = [peft_reference(base, path, prompt, MAX_NEW_TOKENS).token_ids
                   != peft_reference(base, None, prompt, MAX_NEW_TOKENS).token_ids for prompt in PROMPTS]
        assert sum(changed) >= len(PROMPTS) - 1, f"phi3/{name} leaves the output as the base model's"


@pytest.mark.parametrize("mode", list(MODES))
def test_mixed_batch_matches_peft(mode, base, paths, make_llm):
    llm = make_llm(base, enable_lora=True, max_loras=2, max_cpu_loras=2, **MODES[mode])
    requests = mixed_requests(paths)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    check_against_peft(base, paths, requests, outputs, f"phi3/{mode}")


def test_adapters_in_the_other_layout_are_refused_by_name(base, paths, checkpoint, make_llm, tmp_path):
    llm = make_llm(base, enable_lora=True, num_kv_blocks=64, block_size=4)
    split_names = edited(paths["fused"], tmp_path / "split", target_modules=["q_proj", "v_proj"])
    llama_adapter = make_adapter(checkpoint("llama"), tmp_path / "llama", r=4, alpha=8, targets=["q_proj"])
    for path, match in ((split_names, "'q_proj' is not a module of this phi3 model.*qkv_proj"),
                        (llama_adapter, "'q_proj' is not a module of this phi3 model")):
        with pytest.raises(RequestRejected, match=match):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest("other", 1, str(path)))
    assert not llm.engine.has_unfinished_requests()


def test_fused_adapters_split_across_two_ranks_match_peft(base, paths, make_llm):
    """Each rank takes its q, k and v rows (and gate and up rows) of a fused module's B."""
    with make_llm(base, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_cpu_loras=2,
                  **MODES["chunked"]) as llm:
        requests = mixed_requests(paths)
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
    check_against_peft(base, paths, requests, outputs, "phi3/TP=2")
