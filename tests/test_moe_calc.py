"""`pagoda calc` on mixtures of experts: its parameter counts are the checkpoints', and its bytes read per decode
step are within 10% of what the engine reads, counted from the experts each step ran, at batch 1 and 32."""

from __future__ import annotations

import math

import pytest
from conftest import random_prompts
from safetensors import safe_open

from pagoda import SamplingParams
from pagoda.calc.deployment import CalcInputs, derive
from pagoda.calc.presets import resolve_gpu
from pagoda.calc.shapes import expected_experts_hit, shape_from_path
from pagoda.model.moe import GroupedExperts, SparseMoeBlock


def checkpoint_params(model_dir) -> int:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as reader:
        return sum(math.prod(reader.get_slice(name).get_shape()) for name in reader.keys())  # noqa: SIM118


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_parameter_count_is_the_checkpoints(arch, checkpoint):
    model_dir = checkpoint(arch)
    shape = shape_from_path(model_dir)
    assert shape.experts is not None
    assert shape.num_params == checkpoint_params(model_dir)


def test_expected_experts_hit():
    assert expected_experts_hit(8, 2, 1) == pytest.approx(2)
    assert expected_experts_hit(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert expected_experts_hit(8, 2, 1000) == pytest.approx(8)


class StepRouting:
    """For each engine step and sparse layer: (tokens routed, distinct experts run), from the layers' routed-token
    counts before and after the step: whichever path ran it (the native decode stack, the modules), an expert
    with no tokens is not run."""

    def __init__(self, llm) -> None:
        self.calls: list[tuple[int, int]] = []
        blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
        top_k = blocks[0].gate.top_k
        executor = llm.engine.executor
        original = executor.execute_model

        def execute_model(scheduler_output):
            before = [block.routed_counter().clone() for block in blocks]
            output = original(scheduler_output)
            for block, counts in zip(blocks, before, strict=True):
                routed = block.routed_counter() - counts
                self.calls.append((int(routed.sum()) // top_k, int((routed > 0).sum())))
            return output

        executor.execute_model = execute_model


@pytest.mark.parametrize("batch", [1, 32])
def test_bytes_read_per_step_are_calcs_within_ten_percent(batch, checkpoint, make_llm):
    # 64 experts, top 2: at batch 32 a layer runs ~41 of them, so the union matters.
    model_dir = checkpoint("mixtral", num_local_experts=64, intermediate_size=96)
    llm = make_llm(model_dir, num_kv_blocks=512)
    model = llm.engine.model
    expert_params = {id(m): sum(p.numel() for p in m.parameters()) / m.num_experts
                     for m in model.modules() if isinstance(m, GroupedExperts)}
    (per_expert,) = set(expert_params.values())
    routed = {p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    untied_embedding = {model.embed_tokens.weight} if model.lm_head.weight is not model.embed_tokens.weight else set()
    always = sum(p.numel() for p in model.parameters() if p not in routed and p not in untied_embedding)

    routing = StepRouting(llm)
    prompts = random_prompts([5] * batch, seed=batch)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    decode_hits = [hits for tokens, hits in routing.calls if tokens == batch]
    sparse_layers = len(expert_params)
    assert len(decode_hits) == 7 * sparse_layers  # 7 decode steps after the prefill's token
    counted = 4 * (always + per_expert * sum(decode_hits) / (len(decode_hits) / sparse_layers))

    shape = shape_from_path(model_dir)
    deployment = derive(CalcInputs(model=shape, gpu=resolve_gpu("h100-sxm"), dtype="fp32", batch=batch))
    predicted = deployment.weights_read_at(batch)
    assert predicted == pytest.approx(counted, rel=0.10), (predicted, counted, decode_hits)
    if batch == 1:
        assert predicted == pytest.approx(counted, rel=1e-9)  # top_k exactly: no expectation involved
