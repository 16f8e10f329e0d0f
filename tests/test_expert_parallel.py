"""Expert parallelism (docs/moe.md): a mixture of experts at tensor_parallel_size 2 with enable_expert_parallel, its
experts placed across the two ranks, tokens sent to them and back with all_to_all_single over gloo on the CPU.

Greedy fp32 output equals transformers' and the unsplit (EP = 1) engine's token for token (up to the near-tie rule)
for each MoE architecture under batching, chunked prefill with preemption, and prefix-cache hits. Each rank holds
its experts' bytes only (and of the rest, what tensor parallelism gives it); the load per expert and per rank is
counted exactly. What is not built is refused by name before any rank starts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import compare_with_reference, random_prompts
from safetensors import safe_open
from test_correctness import MAX_NEW_TOKENS, PROMPTS, observe_schedules, run_greedy
from test_tensor_parallel import MODES

from pagoda import SamplingParams
from pagoda.calc import formulas
from pagoda.config import ParallelConfig
from pagoda.engine.api import EngineStats, ExpertLoadStats
from pagoda.model.expert_parallel import ExpertParallelMoeBlock
from pagoda.model.loader import load_model_config, safetensors_files
from pagoda.model.moe import SparseMoeBlock
from pagoda.model_dir import ModelLoadError
from pagoda.server.metrics import ServerMetrics

MOE_ARCHS = ["mixtral", "qwen3-moe", "qwen2-moe"]
EP2 = dict(tensor_parallel_size=2, enable_expert_parallel=True)


def sparse_blocks(llm) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ep2_greedy_matches_ep1_and_transformers(arch, mode, checkpoint, hf_reference, make_llm, monkeypatch):
    model_dir = checkpoint(arch)
    references = [hf_reference(model_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    unsplit = run_greedy(make_llm(model_dir, **MODES[mode]), PROMPTS)
    with make_llm(model_dir, **EP2, **MODES[mode]) as llm:
        assert llm.engine.executor.tensor_parallel_size == 2
        blocks = sparse_blocks(llm)
        assert blocks and all(isinstance(block, ExpertParallelMoeBlock) for block in blocks)
        assert all(block.experts.num_experts == block.num_experts // 2 for block in blocks)
        steps = observe_schedules(monkeypatch, llm.engine.scheduler)
        if mode == "prefix-cached":
            run_greedy(llm, PROMPTS)
            steps.clear()
        split = run_greedy(llm, PROMPTS)
        load = llm.engine.stats().experts
    for index, (tokens, single, reference) in enumerate(zip(split, unsplit, references)):
        label = f"{arch}/{mode}/prompt {index} ({len(PROMPTS[index])} tokens)"
        tie = compare_with_reference(tokens, reference, f"{label}, EP=2")
        if tie is not None:
            assert tokens[:tie] == single[:tie], label
        elif tokens != single:  # then EP=1 is the one that met a near-tie, which the rule must excuse
            assert compare_with_reference(single, reference, f"{label}, EP=1") is not None, label
    assert load is not None and min(load.rank_tokens) > 0, "tokens never reached one of the ranks"
    scheduler = llm.engine.scheduler
    if mode == "batched":
        assert len(steps[0]) == len(PROMPTS), "all prompts should be prefilled in the first step"
    elif mode == "chunked+preemption":
        assert scheduler.num_preemptions > 0
        assert max(sum(r[1] for r in s) for s in steps) <= 7
    else:
        assert [r[0] for r in steps[0]] == [(len(p) - 1) // 4 * 4 for p in PROMPTS], "every full block is a hit"


def test_expert_parallelism_inside_pipeline_stages_matches_transformers(checkpoint, hf_reference, make_llm):
    """TP 2 x PP 2 with expert parallelism: each stage's two ranks place that stage's experts between them (the
    stage's own process group carries the all-to-alls); 4 ranks, one layer a stage, Qwen2-MoE's sparse layer on
    the first stage and Qwen3-MoE's dense one on the second included."""
    for arch in ("qwen2-moe", "qwen3-moe"):
        model_dir = checkpoint(arch)
        with make_llm(model_dir, **EP2, pipeline_parallel_size=2, **MODES["chunked+preemption"]) as llm:
            assert len(llm.engine.executor.worker_pids()) == 3
            tokens = run_greedy(llm, PROMPTS[:5])
        for index, (output, prompt) in enumerate(zip(tokens, PROMPTS)):
            reference = hf_reference(model_dir, prompt, MAX_NEW_TOKENS)
            compare_with_reference(output, reference, f"{arch} TP=2 x PP=2, EP/prompt {index}")


_EXPERT = re.compile(r"model\.layers\.\d+\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.")


def expert_parallel_bytes(model_dir: Path, size: int) -> list[int]:
    """Each rank's weight bytes, from the checkpoint: a routed expert's tensors whole on the rank that holds it
    (experts [r E/N, (r+1) E/N) on rank r); the router, the shared expert and its gate, the norms and the biases
    added after an all-reduce whole on every rank, and so are k and v when there are fewer KV heads than ranks;
    every other tensor (attention, dense layers, embedding, LM head) split evenly."""
    config = load_model_config(model_dir)
    assert config.moe is not None
    per_rank = config.moe.num_experts // size
    experts, whole, split = [0] * size, 0, 0
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = reader.get_slice(name)
                nbytes = math.prod(tensor.get_shape()) * {"F32": 4, "BF16": 2}[tensor.get_dtype()]
                if (expert := _EXPERT.match(name)) is not None:
                    experts[int(expert[1]) // per_rank] += nbytes
                elif ("norm" in name or name.endswith(("o_proj.bias", "down_proj.bias", "mlp.gate.weight",
                                                       "block_sparse_moe.gate.weight", "shared_expert_gate.weight"))
                      or ".shared_expert." in name
                      or ("k_proj" in name or "v_proj" in name) and config.num_kv_heads < size):
                    whole += nbytes
                else:
                    split += nbytes
    assert min(experts) > 0 and split > 0 and whole > 0
    return [split // size + whole + held for held in experts]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_each_rank_holds_only_its_experts(arch, checkpoint, make_llm):
    model_dir = checkpoint(arch)
    expected = expert_parallel_bytes(model_dir, 2)
    with make_llm(model_dir, use_kernels=False) as unsplit:
        [whole] = unsplit.engine.executor.weight_bytes_per_rank()
        all_experts = sparse_blocks(unsplit)
    with make_llm(model_dir, **EP2) as llm:
        assert llm.engine.executor.weight_bytes_per_rank() == expected
        # Rank 0 holds the first half of each layer's experts, the checkpoint's own tensors.
        for ours, theirs in zip(sparse_blocks(llm), all_experts, strict=True):
            for index in range(ours.experts.num_experts):
                assert torch.equal(ours.experts.gate_up[index].weight, theirs.experts.gate_up[index].weight)
                assert torch.equal(ours.experts.down[index].weight, theirs.experts.down[index].weight)
    assert sum(expected) < 2 * whole, "the ranks together hold every expert once, not twice"


def test_the_load_is_counted_per_expert_and_per_rank(checkpoint, make_llm):
    """Every token a sparse layer computes goes to top_k experts: the counted pairs are exactly top_k x sparse
    layers x the tokens the steps computed, the same on one rank as on two, and each rank's count is its experts'."""
    model_dir = checkpoint("qwen3-moe")
    moe = load_model_config(model_dir).moe
    assert moe is not None
    loads = []
    for options in ({}, EP2):
        with make_llm(model_dir, **options) as llm:
            run_greedy(llm, PROMPTS[:4])
            stats = llm.engine.stats()
        load = stats.experts
        assert load is not None and len(load.expert_tokens) == moe.num_experts
        assert sum(load.expert_tokens) == moe.top_k * moe.num_sparse_layers * stats.iteration_tokens_sum
        loads.append(load)
    one, two = loads
    assert one.rank_tokens == (sum(one.expert_tokens),)
    half = moe.num_experts // 2
    assert two.rank_tokens == (sum(two.expert_tokens[:half]), sum(two.expert_tokens[half:]))
    assert sum(one.expert_tokens) == sum(two.expert_tokens)


def test_calcs_all_to_all_volume_is_what_rank_0_sends(checkpoint, make_llm, monkeypatch):
    """`pagoda calc`'s expert-parallel all-to-all bytes per sparse layer at batch 32 (uniform routing) within 15% of
    what rank 0 sends rank 1 in the dispatch and combine of 32-token decode steps, counted at the collective."""
    model_dir = checkpoint("mixtral")
    config = load_model_config(model_dir)
    assert config.moe is not None
    batch, sent_per_layer = [0], []
    forward, all_to_all = ExpertParallelMoeBlock.forward, dist.all_to_all_single

    def counting_forward(block, x):
        batch[0] = x.shape[0]
        return forward(block, x)

    def counting_all_to_all(output, input, output_split_sizes, input_split_sizes, group=None):
        if batch[0] == 32:  # the rows rank 0 sends rank 1, fp32
            sent_per_layer.append(input_split_sizes[1] * input.shape[1] * input.element_size())
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group)

    monkeypatch.setattr(ExpertParallelMoeBlock, "forward", counting_forward)
    monkeypatch.setattr(dist, "all_to_all_single", counting_all_to_all)
    with make_llm(model_dir, **EP2, max_num_seqs=32) as llm:
        llm.generate(random_prompts([3] * 32, seed=5), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                     use_tqdm=False)
    # Each sparse layer's step makes two calls (dispatch, combine); 9 decode steps of 32 tokens, 2 sparse layers.
    assert len(sent_per_layer) == 2 * 9 * config.moe.num_sparse_layers
    counted = 2 * sum(sent_per_layer) / len(sent_per_layer)
    predicted = formulas.ep_all_to_all_bytes(32, config.moe.top_k, config.hidden_size, 4, 2)
    assert counted == pytest.approx(predicted, rel=0.15)


def test_the_load_is_exported_one_series_per_expert_and_per_rank():
    stats = EngineStats(experts=ExpertLoadStats(expert_tokens=(5, 0, 7, 2), rank_tokens=(5, 9)))
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'pagoda:moe_expert_tokens_total{expert="2",model_name="m"} 7.0' in text
    assert 'pagoda:moe_rank_tokens_total{model_name="m",rank="1"} 9.0' in text
    assert "pagoda:moe_" not in ServerMetrics("m", EngineStats).render().decode(), "a dense model has no series"


# --- refused by name, before any rank starts ---------------------------------------------------------


def test_a_mixture_of_experts_at_tp2_without_expert_parallelism_names_the_flag(checkpoint, make_llm):
    with pytest.raises(ModelLoadError, match="--enable-expert-parallel"):
        make_llm(checkpoint("mixtral"), tensor_parallel_size=2)


def test_experts_that_do_not_divide_among_the_ranks_are_refused(checkpoint, make_llm):
    with pytest.raises(ModelLoadError, match="num_experts 6 is not a multiple of tensor_parallel_size 4"):
        make_llm(checkpoint("mixtral", num_local_experts=6), tensor_parallel_size=4, enable_expert_parallel=True)


def test_eplb_is_refused_by_name():
    with pytest.raises(ValueError, match="enable_eplb .* is not built"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True)
