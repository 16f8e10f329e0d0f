"""A pipeline step in micro-batches (docs/parallelism.md): `QueryLayout.split` cuts a step's tokens into runs that,
run one after another, are the step (a query cut in two becomes two chunks of its sequence), and a stage hands each
run on as soon as it is done. Greedy output at PP = 2 with decode steps cut into runs equals the unsplit engine's and
transformers' (up to the near-tie rule)."""

from __future__ import annotations

import pytest
import torch
from conftest import compare_with_reference, random_prompts

from pagoda import SamplingParams
from pagoda.engine.rank_placement import MICRO_BATCH_MIN_TOKENS
from pagoda.model.attention import QueryLayout
from pagoda.model.llama import LlamaModel


def mixed_layout(groups: int = 0) -> QueryLayout:
    """A 31-token prefill chunk from position 4, a decode, a chain of two drafts and a branch beside the first."""
    layout = QueryLayout()
    extra = [[7]] * groups
    layout.add(4, [31], [1, 2, 3], extra)
    layout.add(10, [1], [4], extra)
    layout.add(5, [1, 1], [5], extra)
    if not groups:  # branches are not laid out over several groups
        layout.add_branch(5, 99, [5])
    return layout


def token_view(layout: QueryLayout) -> list[tuple[int, list[int], int | None]]:
    """Each token's (position, block table, branch slot) in flat-batch order."""
    tokens = []
    for query, (length, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens)):
        tokens += [(position, layout.block_tables[query], layout.branch_slots.get(query))
                   for position in range(seq_len - length, seq_len)]
    return tokens


@pytest.mark.parametrize("parts", [2, 3, 4, 7])
def test_runs_are_the_step_cut_in_order(parts):
    layout = mixed_layout()
    runs = layout.split(parts)
    assert len(runs) == parts
    assert [run_slice.start for _, run_slice in runs] == [0, *(run_slice.stop for _, run_slice in runs[:-1])]
    assert runs[-1][1].stop == sum(layout.query_lens)
    sizes = [run_slice.stop - run_slice.start for _, run_slice in runs]
    assert max(sizes) - min(sizes) <= 1, "as even as tokens go"
    assert sum((token_view(run) for run, _ in runs), []) == token_view(layout)
    for run, run_slice in runs:
        assert sum(run.query_lens) == run_slice.stop - run_slice.start
        assert all(length > 0 for length in run.query_lens)
    metas = [run.metadata(16, {None}) for run, _ in runs]
    assert torch.equal(torch.cat([meta.positions for meta in metas]), layout.metadata(16, {None}).positions)


def test_runs_carry_every_kv_cache_groups_tables():
    layout = mixed_layout(groups=1)
    runs = layout.split(3)
    for run, _ in runs:
        assert run.group_tables == [[[7]] * len(run.query_lens)]


def test_small_steps_are_not_cut():
    layout = mixed_layout()  # 35 tokens
    assert layout.split(1) == [(layout, slice(0, 35))]
    assert len(layout.split(4, min_tokens=16)) == 2
    assert layout.split(4, min_tokens=36) == [(layout, slice(0, 35))]
    single = QueryLayout()
    single.add(9, [1], [1])
    assert single.split(4) == [(single, slice(0, 1))]


@pytest.mark.parametrize("stages", [2, 3])
def test_decode_steps_in_micro_batches_match_unsplit_and_transformers(stages, checkpoint, hf_reference, make_llm):
    """Enough streams that decode steps alone are cut into runs on rank 0's stage (with 3 stages, a middle stage
    receives and hands on run by run)."""
    model_dir = checkpoint("llama", num_layers=3)
    streams = 3 * MICRO_BATCH_MIN_TOKENS
    prompts = random_prompts([3 + index % 11 for index in range(streams)], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=512, max_num_seqs=streams)
    with make_llm(model_dir, **options) as llm:
        unsplit = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    with make_llm(model_dir, pipeline_parallel_size=stages, **options) as llm:
        runs_per_step = []
        model = llm.engine.runner.model
        assert isinstance(model, LlamaModel)
        stage = model.forward_stage
        calls = []

        def counted(*args, **kwargs):
            calls.append(args[0].shape[0])
            return stage(*args, **kwargs)

        model.forward_stage = counted  # type: ignore[method-assign]
        step = llm.engine.step

        def counted_step():
            calls.clear()
            outputs = step()
            runs_per_step.append(list(calls))
            return outputs

        llm.engine.step = counted_step  # type: ignore[method-assign]
        split = [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    decode_steps = [runs for runs in runs_per_step if sum(runs) == streams]
    assert decode_steps and all(len(runs) == 3 for runs in decode_steps), runs_per_step
    for index, (tokens, single, prompt) in enumerate(zip(split, unsplit, prompts)):
        reference = hf_reference(model_dir, prompt, 8)
        tie = compare_with_reference(tokens, reference, f"prompt {index}, PP = {stages} in micro-batches")
        if tie is not None:
            assert tokens[:tie] == single[:tie], index
        elif tokens != single:
            assert compare_with_reference(single, reference, f"prompt {index}, unsplit") is not None, index
