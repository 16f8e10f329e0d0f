"""Pipeline parallelism (docs/parallelism.md): the layers split into 2 stages, alone (2 ranks) and with each stage
split across 2 tensor-parallel ranks (4 ranks, one thread each), over gloo on the CPU.

Greedy fp32 output equals transformers' and the unsplit engine's token for token (up to the near-tie rule) for
every architecture (tied embeddings, whose LM head is on the other stage; a sliding window on one stage only;
a KV head shared by two ranks) under batching, chunked prefill with preemption, and prefix-cache hits. Each rank
holds its stage's tensors only (its share of them with tensor parallelism) and its stage's layers' KV.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import compare_with_reference
from safetensors import safe_open
from test_correctness import MAX_NEW_TOKENS, PROMPTS, observe_schedules, run_greedy, same_bytes_pool
from test_tensor_parallel import ARCHITECTURES as TP_ARCHITECTURES
from test_tensor_parallel import MODES, process_gone

from pagoda.config import ParallelConfig
from pagoda.model.loader import load_model_config, safetensors_files
from pagoda.model.pipeline import PipelineStage, pipeline_stage, stage_layer_counts
from pagoda.model_dir import ModelLoadError
from pagoda.testing import ARCHITECTURES

LAYOUTS = {"pp2": dict(pipeline_parallel_size=2), "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


# Every architecture in stages, in every mode; with tensor parallelism too where the ranks can split it (OLMo 2's
# q/k norms are refused at TP > 1: tests/test_tensor_parallel.py; the mixtures of experts split there with expert
# parallelism: tests/test_expert_parallel.py),
# there in one mode each, in turn: four processes a case, and each mode's stage logic is the same code at PP=2.
SPLITS = [(arch, "pp2", mode) for arch in ARCHITECTURES for mode in MODES] + [
    (arch, "tp2xpp2", list(MODES)[index % len(MODES)]) for index, arch in enumerate(TP_ARCHITECTURES)]


@pytest.mark.parametrize(("arch", "layout", "mode"), SPLITS)
def test_pipeline_greedy_matches_unsplit_and_transformers(arch, layout, mode, checkpoint, hf_reference, make_llm,
                                                          monkeypatch):
    model_dir = checkpoint(arch)
    references = [hf_reference(model_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    unsplit = run_greedy(make_llm(model_dir, **same_bytes_pool(model_dir, MODES[mode])), PROMPTS)
    with make_llm(model_dir, **LAYOUTS[layout], **MODES[mode]) as llm:
        executor = llm.engine.executor
        assert executor.pipeline_parallel_size == 2
        assert len(executor.worker_pids()) == executor.tensor_parallel_size * 2 - 1
        steps = observe_schedules(monkeypatch, llm.engine.scheduler)
        if mode == "prefix-cached":
            run_greedy(llm, PROMPTS)
            steps.clear()
        split = run_greedy(llm, PROMPTS)
    for index, (tokens, single, reference) in enumerate(zip(split, unsplit, references)):
        label = f"{arch}/{layout}/{mode}/prompt {index} ({len(PROMPTS[index])} tokens)"
        tie = compare_with_reference(tokens, reference, f"{label}, split")
        if tie is not None:
            assert tokens[:tie] == single[:tie], label
        elif tokens != single:  # then the unsplit engine is the one that met a near-tie, which the rule must excuse
            assert compare_with_reference(single, reference, f"{label}, unsplit") is not None, label
    scheduler = llm.engine.scheduler
    if mode == "batched":
        assert len(steps[0]) == len(PROMPTS), "all prompts should be prefilled in the first step"
    elif mode == "chunked+preemption":
        assert scheduler.num_preemptions > 0
        assert max(sum(r[1] for r in s) for s in steps) <= 7
    else:
        assert [r[0] for r in steps[0]] == [(len(p) - 1) // 4 * 4 for p in PROMPTS], "every full block is a hit"


def test_uneven_stages_match_transformers(checkpoint, hf_reference, make_llm):
    """3 layers in 2 stages (2 + 1) and in 3 stages (one each: a middle stage that neither embeds nor samples)."""
    model_dir = checkpoint("qwen2-swa", num_layers=3)
    for stages in (2, 3):
        with make_llm(model_dir, pipeline_parallel_size=stages, **MODES["chunked+preemption"]) as llm:
            assert len(llm.engine.runner.kv_caches) == stage_layer_counts(3, stages)[0]
            tokens = run_greedy(llm, PROMPTS[:4])
        for index, (output, prompt) in enumerate(zip(tokens, PROMPTS)):
            reference = hf_reference(model_dir, prompt, MAX_NEW_TOKENS)
            compare_with_reference(output, reference, f"qwen2-swa, 3 layers, PP={stages}/prompt {index}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def stage_share_bytes(model_dir: Path, tensor_parallel_size: int, stage_layers: list[range]) -> list[int]:
    """Each rank's weight bytes, from the checkpoint, ranks numbered stage by stage: a stage holds its layers'
    tensors, the first the embedding, the last the final norm and the LM head (with tied embeddings, the embedding
    again); of each, a tensor-parallel rank holds 1/T, but of the norms and the biases added after an all-reduce,
    which it holds whole."""
    config = load_model_config(model_dir)
    last = len(stage_layers) - 1
    per_stage = [0] * len(stage_layers)
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = reader.get_slice(name)
                size = math.prod(tensor.get_shape()) * {"F32": 4, "BF16": 2}[tensor.get_dtype()]
                whole = "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias"))
                share = size if whole else size // tensor_parallel_size
                layer = _LAYER.match(name)
                if layer is not None:
                    [holder] = [stage for stage, layers in enumerate(stage_layers) if int(layer[1]) in layers]
                    per_stage[holder] += share
                elif name == "model.embed_tokens.weight":
                    per_stage[0] += share
                    if config.tie_word_embeddings:
                        per_stage[last] += share
                else:
                    assert name in ("model.norm.weight", "lm_head.weight"), name
                    per_stage[last] += share
    return [stage for stage in per_stage for _ in range(tensor_parallel_size)]


@pytest.mark.parametrize(("arch", "layout"), [("llama", "pp2"), ("qwen2", "pp2"), ("llama", "tp2xpp2")])
def test_each_rank_holds_its_stage_and_its_layers_kv(arch, layout, checkpoint, make_llm):
    model_dir = checkpoint(arch)
    options = LAYOUTS[layout]
    tensor = options.get("tensor_parallel_size", 1)
    expected = stage_share_bytes(model_dir, tensor, [range(0, 1), range(1, 2)])
    with make_llm(model_dir, use_kernels=False) as unsplit:
        [whole] = unsplit.engine.executor.weight_bytes_per_rank()
        [whole_kv] = unsplit.engine.executor.kv_bytes_per_rank()
    with make_llm(model_dir, **options) as llm:
        weights = llm.engine.executor.weight_bytes_per_rank()
        kv = llm.engine.executor.kv_bytes_per_rank()
    assert weights == expected
    assert max(weights) < 0.75 * whole / tensor, "a rank holds more than its stage"
    # Every rank has the pool's block count for its one layer of two, and its share of the KV heads.
    assert kv == [whole_kv // 2 // tensor] * 2 * tensor


def test_stage_layer_split():
    assert stage_layer_counts(4, 2) == [2, 2]
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(7, 4) == [2, 2, 2, 1], "the remainder goes to the stages before the last"
    assert pipeline_stage(7, 4, 2) == PipelineStage(2, 4, 4, 6)
    with pytest.raises(ModelLoadError, match="num_hidden_layers 2 is fewer than the stages"):
        stage_layer_counts(2, 3)


def test_a_model_with_fewer_layers_than_stages_is_refused_before_anything_starts(checkpoint, make_llm):
    with pytest.raises(ModelLoadError, match="pipeline_parallel_size 3 cannot split this model"):
        make_llm(checkpoint("llama"), pipeline_parallel_size=3)


def test_pipeline_options():
    assert ParallelConfig(pipeline_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match='needs "mp"'):
        ParallelConfig(pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="pipeline_parallel_size must be positive"):
        ParallelConfig(pipeline_parallel_size=0)


def test_closing_stops_every_rank(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama"), tensor_parallel_size=2, pipeline_parallel_size=2)
    pids = llm.engine.executor.worker_pids()
    assert len(pids) == 3 and not any(process_gone(pid) for pid in pids)
    run_greedy(llm, PROMPTS[:2])
    llm.close()
    assert all(process_gone(pid) for pid in pids)
