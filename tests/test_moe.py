"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): routing, the sorted dispatch, what each architecture's
settings change, speculation, quantization per expert, and what is refused by name.

Greedy fp32 output against `transformers` under batching, chunked prefill, preemption and prefix hits is
test_correctness.py's (the MoE checkpoints are among its architectures)."""

from __future__ import annotations

import statistics

import pytest
import torch
from conftest import compare_with_reference, random_prompts

from pagoda import SamplingParams
from pagoda.config import ModelConfig
from pagoda.model.int4 import Int4Linear
from pagoda.model.layers import GatedMLP
from pagoda.model.loader import load_model_config
from pagoda.model.moe import GroupedExperts, SparseMoeBlock
from pagoda.model.quantization import DenseLinear, Int8Linear
from pagoda.model_dir import ModelLoadError
from pagoda.moe_config import MoEConfig, MoEConfigError, read_moe_config

MOE_ARCHS = ["mixtral", "qwen3-moe", "qwen2-moe"]
PROMPTS = random_prompts([1, 6, 17, 33], seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def generate_ids(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def sparse_blocks(llm) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


class ExpertCalls:
    """Records every expert computation: (layer block, expert, rows)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        original = GroupedExperts.forward_expert
        calls = self.calls

        def forward_expert(experts, expert, rows):
            calls.append((id(experts), expert, rows.shape[0]))
            return original(experts, expert, rows)

        monkeypatch.setattr(GroupedExperts, "forward_expert", forward_expert)


# --- settings ------------------------------------------------------------------------------------


def test_qwen_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    hf = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
          "mlp_only_layers": [3]}
    moe = read_moe_config(hf, "qwen3_moe", 6)
    assert moe is not None and moe.sparse_layers == (False, True, False, False, False, True)
    assert moe.norm_topk_prob is False and moe.shared_expert_intermediate_size == 0
    qwen2 = read_moe_config({**hf, "shared_expert_intermediate_size": 64, "norm_topk_prob": True}, "qwen2_moe", 2)
    assert qwen2 == MoEConfig(8, 2, 32, True, (False, True), 64)


def test_mixtral_routes_every_layer_and_renormalises():
    moe = read_moe_config({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96}, "mixtral", 3)
    assert moe == MoEConfig(8, 2, 96, True, (True, True, True))
    assert read_moe_config({}, "llama", 3) is None


@pytest.mark.parametrize(("hf", "message"), [
    ({"num_experts_per_tok": 2, "moe_intermediate_size": 8}, "'num_local_experts' is missing"),
    ({"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8}, "'num_experts_per_tok' = 5"),
])
def test_bad_expert_fields_are_named(hf, message):
    with pytest.raises(MoEConfigError, match=message):
        read_moe_config(hf, "qwen3_moe", 2)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_loaded_layers_follow_the_config(arch, checkpoint, make_llm):
    model_dir = checkpoint(arch)
    config: ModelConfig = load_model_config(model_dir)
    assert config.moe is not None
    layers = list(make_llm(model_dir).engine.model.layers)
    for layer, sparse in zip(layers, config.moe.sparse_layers):
        assert isinstance(layer.mlp, SparseMoeBlock if sparse else GatedMLP)
    if arch == "qwen3-moe":
        assert config.moe.sparse_layers == (True, False) and config.qk_norm and config.moe.norm_topk_prob
    if arch == "qwen2-moe":
        assert config.attention_bias and config.moe.shared_expert_intermediate_size == 96
        assert all(block.shared_expert is not None for block in sparse_blocks(make_llm(model_dir)))


# --- the layer -----------------------------------------------------------------------------------


def dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, masked to each token's top k: the definition, with no sorting."""
    probabilities = torch.softmax(block.gate(x).float(), dim=-1)
    weights, chosen = torch.topk(probabilities, block.gate.top_k, dim=-1)
    if block.gate.renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for expert in range(block.experts.num_experts):
        hit = (chosen == expert).float() * weights  # [tokens, k]: the weight where the token chose it
        out += block.experts.forward_expert(expert, x) * hit.sum(dim=-1, keepdim=True)
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        out += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_sorted_dispatch_equals_every_expert_masked(arch, num_tokens, checkpoint, make_llm):
    block = sparse_blocks(make_llm(checkpoint(arch), use_kernels=False))[0]
    x = torch.randn(num_tokens, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(num_tokens))
    torch.testing.assert_close(block(x.clone()), dense_reference(block, x), rtol=1e-5, atol=1e-5)


def test_batch_one_decode_runs_only_the_chosen_experts(checkpoint, make_llm, monkeypatch):
    """At batch 1 each sparse layer computes exactly top_k experts a step, each over one row: the other experts'
    weights are never read. (Through the modules; the native decode stack computes the same experts, bit for bit:
    test_native_decode.py.)"""
    llm = make_llm(checkpoint("mixtral"))
    llm.engine.model.backend.decode_runner = None
    blocks = sparse_blocks(llm)
    spy = ExpertCalls(monkeypatch)
    generate_ids(llm, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    decode_calls = [call for call in spy.calls if call[2] == 1]
    top_k = blocks[0].gate.top_k
    # 5 decode steps (the first token comes from the prefill), each: len(blocks) layers x top_k experts.
    assert len(decode_calls) == 5 * len(blocks) * top_k
    assert len({call[1] for call in decode_calls}) > top_k, "routing never changed: the router is not exercised"


@pytest.mark.parametrize(("arch", "field", "value"), [
    ("qwen3-moe", "norm_topk_prob", False),
    ("qwen2-moe", "norm_topk_prob", True),
    ("qwen3-moe", "mlp_only_layers", None),
    ("qwen2-moe", "decoder_sparse_step", 2),
])
def test_each_setting_changes_the_reference_and_pagoda_follows(arch, field, value, checkpoint, hf_reference,
                                                                make_llm):
    """The settings the tests rely on matter: flipped, transformers continues differently, and pagoda still
    matches it."""
    base, flipped = checkpoint(arch), checkpoint(arch, **{field: value})
    prompts = PROMPTS[1:]
    before = [hf_reference(base, prompt, 16) for prompt in prompts]
    after = [hf_reference(flipped, prompt, 16) for prompt in prompts]
    assert [r.token_ids for r in before] != [r.token_ids for r in after]
    for index, (tokens, reference) in enumerate(zip(generate_ids(make_llm(flipped), prompts), after)):
        compare_with_reference(tokens, reference, f"{arch} {field}={value}/{index}")


def test_the_shared_expert_gate_matters(checkpoint, make_llm):
    """Qwen2-MoE's shared expert is scaled by sigmoid(shared_expert_gate): a gate shifted far down turns the
    shared expert off and changes the output."""
    model_dir = checkpoint("qwen2-moe")
    expected = generate_ids(make_llm(model_dir), PROMPTS)
    llm = make_llm(model_dir)
    for block in sparse_blocks(llm):
        assert block.shared_expert_gate is not None
        block.shared_expert_gate.weight.data.zero_()  # sigmoid(0) = 1/2 instead of the checkpoint's gate
    assert generate_ids(llm, PROMPTS) != expected


# --- speculation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ngram_speculation_keeps_the_output_and_matches_transformers(arch, checkpoint, hf_reference, make_llm):
    model_dir = checkpoint(arch, init_std=0.1)  # greedy output falls into loops: n-gram drafts get accepted
    prompts = [[31, 32, 33, 34] * 4, [50, 51, 52] * 3, *PROMPTS[1:3]]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    llm = make_llm(model_dir, speculative_config=speculative)
    actual = generate_ids(llm, prompts)
    assert actual == generate_ids(make_llm(model_dir), prompts)
    for index, (tokens, prompt) in enumerate(zip(actual, prompts)):
        compare_with_reference(tokens, hf_reference(model_dir, prompt, 16), f"{arch}/ngram/{index}")
    stats = llm.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0


# --- quantization ----------------------------------------------------------------------------------


def _prompt_logprobs(llm, prompts) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    values = []
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        values += [lp[token] for token, lp in zip(prompt[1:], output.prompt_logprobs[1:])]
    return values


# The dense models' bounds on mean |logprob error| against fp32 (test_fast_paths.py), and the layer output's
# relative error a quantized expert may add (int8 per channel; int4 in groups of 32).
DENSE_BOUND = {"int8": 0.06, "int4": 0.9}
LAYER_BOUND = {"int8": 0.02, "int4": 0.2}


@pytest.mark.parametrize(("arch", "quantization", "layer_type"), [
    ("mixtral", "int8", Int8Linear),
    ("qwen2-moe", "int8", Int8Linear),
    ("mixtral", "int4", Int4Linear),
    ("qwen3-moe", "int4", Int4Linear),
])
def test_experts_quantize_one_by_one_within_the_dense_bounds(arch, quantization, layer_type, checkpoint, make_llm):
    """Each expert is its own quantized layer. On the same input a sparse layer's output stays within the
    quantization's layer bound of fp32's (the router is not quantized: the same experts are chosen). End to end,
    the typical |logprob error| against fp32 (the median) is within the dense models' bound; the mean may reach
    twice it, since a perturbed hidden state flips a near-tied routing choice now and then and such a position
    then runs other experts (these random test models route close to evenly)."""
    model_dir = checkpoint(arch)
    prompts = random_prompts([9, 23, 40])
    exact_llm = make_llm(model_dir)
    reference = _prompt_logprobs(exact_llm, prompts)
    llm = make_llm(model_dir, quantization=quantization)
    x = torch.randn(24, load_model_config(model_dir).hidden_size, generator=torch.Generator().manual_seed(3))
    for exact, block in zip(sparse_blocks(exact_llm), sparse_blocks(llm), strict=True):
        assert all(isinstance(layer, layer_type) for layer in [*block.experts.gate_up, *block.experts.down])
        assert len(block.experts.gate_up) == block.experts.num_experts
        expected = exact(x.clone())
        relative = ((block(x.clone()) - expected).norm() / expected.norm()).item()
        assert 0 < relative < LAYER_BOUND[quantization], relative
    errors = [abs(a - b) for a, b in zip(reference, _prompt_logprobs(llm, prompts))]
    summary = f"median {statistics.median(errors):.4f}, mean {statistics.mean(errors):.4f}, max {max(errors):.4f}"
    assert statistics.median(errors) < DENSE_BOUND[quantization], summary
    assert statistics.mean(errors) < 2 * DENSE_BOUND[quantization], summary


def test_unquantized_experts_are_views_of_one_grouped_tensor(checkpoint, make_llm):
    """fp32 experts keep the storage they were loaded into: one tensor per projection and layer."""
    block = sparse_blocks(make_llm(checkpoint("mixtral")))[0]
    storages = {layer.weight.untyped_storage().data_ptr() for layer in block.experts.gate_up}
    assert len(storages) == 1
    assert all(isinstance(layer, (DenseLinear, torch.nn.Linear)) for layer in block.experts.gate_up)


# --- refused by name -------------------------------------------------------------------------------


def test_lora_on_a_mixture_of_experts_is_refused(checkpoint, make_llm):
    with pytest.raises(ValueError, match="not served on a mixture-of-experts model"):
        make_llm(checkpoint("qwen3-moe"), enable_lora=True)


def test_tensor_parallel_experts_without_expert_parallelism_are_refused(checkpoint):
    """The loader's own check, for a caller that builds a rank's model without the engine's: experts are placed
    across ranks (tests/test_expert_parallel.py), never sliced."""
    from pagoda.model.loader import load_model
    from pagoda.model.parallel import TensorParallel

    with pytest.raises(ModelLoadError, match="--enable-expert-parallel"):
        load_model(checkpoint("mixtral"), parallel=TensorParallel(rank=0, world_size=2))
