"""Quantized weights split across ranks (docs/parallelism.md, docs/quantization.md): int8 and int4 quantized at
load, and GPTQ/AWQ checkpoints, at tensor_parallel_size 2, pipeline_parallel_size 2, and (int8, a mixture of
experts) under expert parallelism, over gloo on the CPU.

A rank quantizes its own shard, with the unsplit model's scales: its codes and scales are the unsplit layer's,
sliced (checked here directly on rank 0's layers), so the split model computes the same weights and differs from
the unsplit one only in summation order. Greedy output therefore equals the unsplit model's (same quantization)
token for token, up to the suite's near-tie rule judged on the unsplit model's own top-2 logprobs at the step
where they part (`same_as_unsplit`). The int8 model also matches transformers running the dequantized weights.
Each rank holds half of the split tensors (codes, scales) and all of the replicated ones (norms, and int8's
per-row scales of the row-parallel layers, which every rank needs whole).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import compare_with_reference
from safetensors.torch import load_file, save_file
from test_correctness import MAX_NEW_TOKENS, PROMPTS
from test_int4_checkpoints import _quantized_pair
from test_tensor_parallel import MODES

from pagoda import SamplingParams
from pagoda.model.int4 import Int4Linear
from pagoda.model.llama import fused_row_offsets
from pagoda.model.parallel import QuantizedRowParallel
from pagoda.model.quantization import Int8Linear
from pagoda.model_dir import ModelLoadError
from tests.conftest import Reference

TP2 = dict(tensor_parallel_size=2)
PROMPT_SET = PROMPTS[:6]  # lengths 1 to 34


def greedy_with_top2(llm, prompts, vocab: int = 512) -> tuple[list[list[int]], list[Reference]]:
    """Greedy tokens, and each sequence's top-2 logprobs per step as a Reference (other tokens at -inf): the
    near-tie rule then reads logprob gaps, which are the logit gaps."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=2)
    tokens, tops = [], []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        logits = torch.full((len(completion.token_ids), vocab), float("-inf"))
        for position, step in enumerate(completion.logprobs):
            for token, logprob in step.items():
                logits[position, token] = logprob
        tokens.append(list(completion.token_ids))
        tops.append(Reference(list(completion.token_ids), logits))
    return tokens, tops


def same_as_unsplit(split: list[list[int]], unsplit: list[Reference], label: str) -> None:
    """Each split sequence equals the unsplit one, or parts from it only where the unsplit model's two best tokens
    were within the near-tie rule (at most MAX_NEAR_TIES_PER_TEST sequences a test)."""
    for index, (tokens, reference) in enumerate(zip(split, unsplit)):
        compare_with_reference(tokens, reference, f"{label}/prompt {index}")


def tensors_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers, by name: what weight_bytes counts."""
    named = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                named[f"{module_name}.{name}"] = buffer
    return named


def in_stage(name: str, stage: int | None) -> bool:
    """Whether a 2-layer model's tensor is on pipeline stage `stage` of 2 (None: no stages)."""
    first = name.startswith(("embed_tokens.", "layers.0."))
    return stage is None or first == (stage == 0)


def expected_rank_bytes(unsplit: torch.nn.Module, ranks: int, stage: int | None = None) -> int:
    """A rank's bytes from the unsplit model's tensors (of its pipeline stage): norms and int8's row-parallel
    scales whole, the rest 1/ranks."""
    split = whole = 0
    for name, tensor in tensors_by_name(unsplit).items():
        if not in_stage(name, stage):
            continue
        size = tensor.numel() * tensor.element_size()
        if "norm" in name or name.endswith(("o_proj.scale", "down_proj.scale")):
            whole += size
        else:
            split += size
    assert split % ranks == 0 and split > 4 * whole
    return split // ranks + whole


def rank0_rows(unsplit_weight: torch.Tensor, layer: str, config) -> torch.Tensor:
    """Rank 0's share (of 2) of an unsplit layer's [out, in] weight, in the order rank 0 holds it."""
    out, columns = unsplit_weight.shape
    if layer in ("o_proj", "down_proj"):
        return unsplit_weight[:, : columns // 2]
    offsets = fused_row_offsets(config)[layer]
    sizes = {"qkv_proj": {"q": config.num_heads * config.head_dim, "k": config.num_kv_heads * config.head_dim,
                          "v": config.num_kv_heads * config.head_dim},
             "gate_up_proj": {"gate": config.intermediate_size, "up": config.intermediate_size}}[layer]
    return torch.cat([unsplit_weight[offsets[part]: offsets[part] + sizes[part] // 2] for part in offsets])


def dequantized(layer: torch.nn.Module) -> torch.Tensor:
    """The fp32 [out, in] weight a quantized layer computes with."""
    if isinstance(layer, QuantizedRowParallel):
        layer = layer.local
    if isinstance(layer, Int8Linear):
        return layer.qweight.float() * layer.scale[:, None]
    assert isinstance(layer, Int4Linear) and layer.input_order is None
    return layer.dequantize()[: layer.out_features, : layer.in_features]


def assert_rank0_holds_the_unsplit_weights_sliced(split_model, unsplit_model, kind) -> None:
    config = unsplit_model.config
    for index, layer in enumerate(unsplit_model.layers):
        for module, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                             ("mlp", "down_proj")):
            shard = getattr(getattr(split_model.layers[index], module), name)
            whole = getattr(getattr(layer, module), name)
            row_parallel = name in ("o_proj", "down_proj")
            assert isinstance(shard, QuantizedRowParallel) == row_parallel
            assert isinstance(shard.local if row_parallel else shard, kind)
            assert torch.equal(dequantized(shard), rank0_rows(dequantized(whole), name, config)), f"{index} {name}"
            local = shard.local if row_parallel else shard  # the shard runs the kernel the whole layer runs
            assert local.matmul_name == whole.matmul_name, (local.matmul_name, whole.matmul_name)
            if kind is Int8Linear and row_parallel:  # the whole row's scales: some rows peak on the other rank
                assert torch.equal(shard.local.scale, whole.scale)
                assert bool((shard.local.qweight.abs().amax(dim=1) < 127).any())


def dequantized_checkpoint(model, source: Path, target: Path) -> Path:
    """`source` with every quantized linear of `model` (an unsplit int8 model) replaced by its dequantized fp32
    weight: what transformers runs to check pagoda's int8 arithmetic."""
    shutil.copytree(source, target)
    [file] = target.glob("*.safetensors")
    tensors = load_file(str(file))
    config = model.config
    assert not config.tie_word_embeddings
    sizes = {"q": config.num_heads * config.head_dim, "k": config.num_kv_heads * config.head_dim,
             "v": config.num_kv_heads * config.head_dim, "gate": config.intermediate_size,
             "up": config.intermediate_size}
    for index, layer in enumerate(model.layers):
        for module, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            weight = dequantized(getattr(getattr(layer, module), fused))
            for part, offset in fused_row_offsets(config)[fused].items():
                tensors[f"model.layers.{index}.{module}.{part}_proj.weight"] = weight[offset: offset + sizes[part]]
        tensors[f"model.layers.{index}.self_attn.o_proj.weight"] = dequantized(layer.self_attn.o_proj)
        tensors[f"model.layers.{index}.mlp.down_proj.weight"] = dequantized(layer.mlp.down_proj)
    tensors["lm_head.weight"] = dequantized(model.lm_head)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(file))
    return target


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_quantizes_each_shard_with_the_unsplit_scales(quantization, checkpoint, hf_reference, make_llm,
                                                          tmp_path):
    model_dir = checkpoint("llama")
    options = dict(quantization=quantization, **MODES["chunked+preemption"])
    with make_llm(model_dir, **options) as unsplit_llm:
        unsplit, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
        unsplit_model = unsplit_llm.engine.model
        [unsplit_bytes] = unsplit_llm.engine.executor.weight_bytes_per_rank()
        with make_llm(model_dir, **TP2, **options) as llm:
            split = [list(t) for t in greedy_with_top2(llm, PROMPT_SET)[0]]
            kind = Int8Linear if quantization == "int8" else Int4Linear
            assert_rank0_holds_the_unsplit_weights_sliced(llm.engine.model, unsplit_model, kind)
            assert isinstance(llm.engine.model.lm_head, kind)
            per_rank = llm.engine.executor.weight_bytes_per_rank()
            assert llm.engine.scheduler.num_preemptions > 0
        assert per_rank == [expected_rank_bytes(unsplit_model, 2)] * 2
        assert max(per_rank) < 0.55 * unsplit_bytes
        same_as_unsplit(split, top2, f"{quantization} TP=2")
        if quantization == "int8":  # transformers on the dequantized weights
            reference_dir = dequantized_checkpoint(unsplit_model, model_dir, tmp_path / "int8-dequantized")
            for index, (tokens, prompt) in enumerate(zip(split, PROMPT_SET)):
                compare_with_reference(tokens, hf_reference(reference_dir, prompt, MAX_NEW_TOKENS),
                                       f"int8 TP=2 against transformers/prompt {index}")
    assert unsplit == [r.token_ids for r in top2]


@pytest.mark.parametrize(("quantization", "options"), [
    ("int4", dict(pipeline_parallel_size=2)),
    ("int8", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),  # the load's all-reduce on a stage's group
], ids=["int4-pp2", "int8-tp2-pp2"])
def test_pipeline_stages_split_quantized_weights(quantization, options, checkpoint, make_llm):
    model_dir = checkpoint("llama")
    with make_llm(model_dir, quantization=quantization) as unsplit_llm:
        _, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
        [unsplit_bytes] = unsplit_llm.engine.executor.weight_bytes_per_rank()
        unsplit_model = unsplit_llm.engine.model
    with make_llm(model_dir, quantization=quantization, **options) as llm:
        split, _ = greedy_with_top2(llm, PROMPT_SET)
        per_rank = llm.engine.executor.weight_bytes_per_rank()
    tensor = options.get("tensor_parallel_size", 1)
    # Ranks stage by stage; each holds its stage's quantized tensors, split across the stage's ranks.
    assert per_rank == [expected_rank_bytes(unsplit_model, tensor, stage) for stage in (0, 1) for _ in range(tensor)]
    if tensor == 1:
        assert sum(per_rank) == unsplit_bytes, "the stages hold the model between them, nothing twice"
    same_as_unsplit(split, top2, f"{quantization} {options}")


# Biases on q/k/v and tied embeddings (qwen2), one KV head on both ranks (llama-mqa), q/k/v and gate/up fused in
# the checkpoint, split and then sliced (phi3), soft-capped attention (gemma2).
@pytest.mark.parametrize("arch", ["qwen2", "llama-mqa", "phi3", "gemma2"])
def test_int8_tp2_across_architectures(arch, checkpoint, make_llm):
    model_dir = checkpoint(arch)
    with make_llm(model_dir, quantization="int8") as unsplit_llm:
        _, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
    with make_llm(model_dir, quantization="int8", **TP2) as llm:
        split, _ = greedy_with_top2(llm, PROMPT_SET)
        assert isinstance(llm.engine.model.layers[0].self_attn.o_proj.local, Int8Linear)
    same_as_unsplit(split, top2, f"{arch} int8 TP=2")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_tp2_splits_a_prequantized_checkpoint(method, checkpoint, make_llm, tmp_path):
    quantized_dir, _ = _quantized_pair(checkpoint("llama", intermediate_size=128), tmp_path, method)
    with make_llm(quantized_dir) as unsplit_llm:
        _, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
        unsplit_model = unsplit_llm.engine.model
        with make_llm(quantized_dir, **TP2) as llm:
            split, _ = greedy_with_top2(llm, PROMPT_SET)
            assert_rank0_holds_the_unsplit_weights_sliced(llm.engine.model, unsplit_model, Int4Linear)
            per_rank = llm.engine.executor.weight_bytes_per_rank()
        assert per_rank == [expected_rank_bytes(unsplit_model, 2)] * 2
    same_as_unsplit(split, top2, f"{method} TP=2")


def test_pipeline_stages_split_a_gptq_checkpoint(checkpoint, make_llm, tmp_path):
    quantized_dir, _ = _quantized_pair(checkpoint("llama", intermediate_size=128), tmp_path, "gptq")
    with make_llm(quantized_dir) as unsplit_llm:
        _, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
        [unsplit_bytes] = unsplit_llm.engine.executor.weight_bytes_per_rank()
    with make_llm(quantized_dir, pipeline_parallel_size=2) as llm:
        split, _ = greedy_with_top2(llm, PROMPT_SET)
        assert isinstance(llm.engine.model.layers[0].self_attn.o_proj, Int4Linear)
        assert sum(llm.engine.executor.weight_bytes_per_rank()) == unsplit_bytes
    same_as_unsplit(split, top2, "gptq PP=2")


def test_expert_parallel_quantizes_each_ranks_experts(checkpoint, make_llm):
    model_dir = checkpoint("mixtral")
    with make_llm(model_dir, quantization="int8") as unsplit_llm:
        _, top2 = greedy_with_top2(unsplit_llm, PROMPT_SET)
        unsplit_experts = unsplit_llm.engine.model.layers[0].mlp.experts
        with make_llm(model_dir, quantization="int8", tensor_parallel_size=2, enable_expert_parallel=True) as llm:
            split, _ = greedy_with_top2(llm, PROMPT_SET)
            experts = llm.engine.model.layers[0].mlp.experts
            assert experts.num_experts == unsplit_experts.num_experts // 2
            for mine, whole in zip(experts.down, unsplit_experts.down):  # rank 0 holds the first experts
                assert isinstance(mine, Int8Linear) and torch.equal(mine.qweight, whole.qweight)
    same_as_unsplit(split, top2, "int8 EP=2")


def test_splits_off_the_groups_are_refused_before_anything_starts(checkpoint, make_llm, tmp_path):
    model_dir = checkpoint("llama")  # o_proj: 64 input columns, 32 a rank
    with pytest.raises(ModelLoadError, match="group size 64: a rank's share of a row-parallel layer must be whole "
                                             "groups, and o_proj's 32 input columns a rank"):
        make_llm(model_dir, quantization="int4", quantization_config={"group_size": 64}, **TP2)
    quantized_dir, _ = _quantized_pair(checkpoint("llama", intermediate_size=128), tmp_path, "gptq")
    config_path = quantized_dir / "config.json"
    config = config_path.read_text()
    config_path.write_text(config.replace('"desc_act": false', '"desc_act": true'))
    with pytest.raises(ModelLoadError, match="it is act-order"):
        make_llm(quantized_dir, **TP2)
    config_path.write_text(config.replace('"group_size": 32', '"group_size": 64'))
    with pytest.raises(ModelLoadError, match="this gptq checkpoint of group size 64"):
        make_llm(quantized_dir, **TP2)
