"""Speculative decoding with a draft model: greedy output is unchanged, sampled output follows the target.

Greedy: the same requests on an engine with a draft model and on one without give the same completions
token for token, for k = 1..5, beside requests that do not speculate, under chunked prefill, preemption,
prefix-cache hits and n > 1. Three drafts: the target itself (which must accept every draft: its KV,
mirrored slot for slot, is then provably the target's, also after preemptions and prefix-cache hits), the
target's own int8 copy (accepts most) and a smaller model with other weights (accepts almost nothing).
Sampled: a chi-square test of the first checked token's frequencies against the target's softmax, which
the naive rule (keep every draft) fails by far. The conftest checks that every KV block came back (the
draft's cache has no blocks of its own: it follows the target's block tables).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from reference_kernels import ReferenceKernels
from test_speculative import (
    PROMPTS,
    REPEATING,
    RowCountingStack,
    assert_same_outputs,
    generate,
    record_steps,
    run_staggered,
    spec_stats,
)

import pagoda.kernels
from pagoda import SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.engine import runner as runner_module
from pagoda.engine.core.drafts import Draft
from pagoda.engine.core.request import Request
from pagoda.engine.draft_model import DraftMismatch
from pagoda.engine.sampler import Proposal, SampleRow, build_sampling_metadata, sample
from pagoda.server.metrics import ServerMetrics
from pagoda.structured import StructuredOutputsParams

ARCH = "llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def draft_spec(model_dir: Path, k: int, **options) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k, **options}


@pytest.fixture(scope="module")
def target_dir(checkpoint) -> Path:
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def small_draft_dir(checkpoint) -> Path:
    """Same vocabulary and tokenizer, other weights, another size (one layer, one KV head, head_dim 16)."""
    return checkpoint(ARCH, seed=7, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      intermediate_size=64)


@pytest.fixture(scope="module")
def drafts(target_dir, small_draft_dir) -> dict[str, dict]:
    """Draft settings by name (model and its own quantization), for a given k."""
    return {
        "self": {"model": str(target_dir)},
        "int8-self": {"model": str(target_dir), "quantization": "int8"},
        "int4-self": {"model": str(target_dir), "quantization": "int4"},
        "small": {"model": str(small_draft_dir)},
        # The draft's 4 likeliest first tokens checked at once: a wrong first guess is often saved.
        "int4-branches": {"model": str(target_dir), "quantization": "int4", "first_token_candidates": 4},
    }


def with_draft(make_llm, target_dir: Path, draft: dict, k: int, **options):
    return make_llm(target_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": k, **draft},
                    **options)


def assert_accepts_everything(llm) -> None:
    stats = spec_stats(llm)
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def spy_kept_alternatives(monkeypatch) -> list[bool]:
    """Per speculating step from now on: did it keep an alternative (rather than the chain's run)?"""
    kept_alternatives: list[bool] = []
    accepted_rows = runner_module.accepted_rows

    def spy(drafts, alternatives, sampled):
        rows = accepted_rows(drafts, alternatives, sampled)
        if drafts:
            kept_alternatives.append(len(rows) == 2 and rows[1] > len(drafts))
        return rows

    monkeypatch.setattr(runner_module, "accepted_rows", spy)
    return kept_alternatives


# --------------------------------------------------------------------------------------------------
# Greedy: equal to decoding without speculation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
@pytest.mark.parametrize("draft", ["self", "small"])
def test_a_whole_draft_beside_a_split_target_leaves_greedy_output_unchanged(make_llm, target_dir, drafts, draft,
                                                                            split):
    """The target split across two ranks (tensor or pipeline), the draft whole in rank 0's process, its KV
    following the target's block tables: greedy output is the split target's own, under chunked prefill (with
    preemption, for the draft that is often wrong)."""
    options = dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=7, **split)
    with make_llm(target_dir, **options) as llm:
        expected = generate(llm, PROMPTS, GREEDY)
    with with_draft(make_llm, target_dir, drafts[draft], 3, **options) as llm:
        actual = generate(llm, PROMPTS, GREEDY)
        assert spec_stats(llm).num_drafts > 0
        if draft == "self":
            assert_accepts_everything(llm)
        else:  # (the self-draft's accepted runs take fewer steps, which this pool holds without preempting)
            assert llm.engine.scheduler.num_preemptions > 0
    assert_same_outputs(expected, actual)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("draft", ["self", "int8-self", "int4-self", "small", "int4-branches"])
def test_greedy_output_is_unchanged_beside_requests_that_do_not_speculate(make_llm, target_dir, drafts, draft, k):
    # max_tokens 1 and 2 leave no room for drafts: those requests decode one token a step beside the others.
    params = [GREEDY] * 4 + [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2)]
    prompts = PROMPTS[:6]
    expected = generate(make_llm(target_dir), prompts, params)
    llm = with_draft(make_llm, target_dir, drafts[draft], k)
    steps = record_steps(llm)
    assert_same_outputs(expected, generate(llm, prompts, params))
    assert any(any(d for d, _ in step) and not all(d for d, _ in step) for step in steps)
    stats = spec_stats(llm)
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == k
    if draft == "self":
        assert_accepts_everything(llm)
    if draft == "int8-self":
        assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    if draft == "int4-self":  # 4 bits on this tiny wide-logit model: its first guess is right ~40% of the time
        assert stats.accepted_per_position[0] > stats.num_drafts / 4


def test_with_the_native_decode_stack(make_llm, target_dir, drafts, monkeypatch):
    """With the kernels (their torch stand-ins here) the target and the draft each run decode-only steps on
    their native decode stacks, the draft's over its KV tensors with the scratch blocks."""
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", ReferenceKernels)
    expected = generate(make_llm(target_dir), PROMPTS[:4], GREEDY)
    llm = with_draft(make_llm, target_dir, drafts["self"], 3)
    runner = llm.engine.draft_proposer.model.backend.decode_runner
    assert runner is not None
    runner.stack = RowCountingStack(runner.stack)
    assert_same_outputs(expected, generate(llm, PROMPTS[:4], GREEDY))
    assert_accepts_everything(llm)
    assert len(runner.stack.rows) > 0 and max(runner.stack.rows) > len(PROMPTS[:4])  # proposals and checked rows
    llm = with_draft(make_llm, target_dir, drafts["int4-branches"], 2)  # branches: slots past the drafts
    assert_same_outputs(expected, generate(llm, PROMPTS[:4], GREEDY))


@pytest.mark.parametrize("k", [1, 3])
def test_alternatives_save_steps_whose_first_draft_fails(make_llm, target_dir, drafts, monkeypatch, k):
    """With first_token_candidates, a greedy request's first draft position is also checked with the draft's
    next likeliest tokens, each on a branch of its own: where the first draft is wrong and an alternative is
    right, the step keeps that alternative and the target's token after it (its K/V moved to the position's
    slot). The output is unchanged; more first positions are accepted than with the first draft alone."""
    kept_branch = spy_kept_alternatives(monkeypatch)
    expected = generate(make_llm(target_dir), PROMPTS[:4], GREEDY)
    first_accepted = {}
    for draft in ("int4-self", "int4-branches"):
        llm = with_draft(make_llm, target_dir, drafts[draft], k)
        assert_same_outputs(expected, generate(llm, PROMPTS[:4], GREEDY))
        stats = spec_stats(llm)
        first_accepted[draft] = stats.accepted_per_position[0] / stats.num_drafts
    assert any(kept_branch)
    assert first_accepted["int4-branches"] > first_accepted["int4-self"] + 0.1


@pytest.mark.parametrize("draft", ["self", "small"])
def test_a_step_of_k_drafts_runs_the_draft_k_times(make_llm, target_dir, drafts, draft):
    """The draft's forward over a step's kept tokens also samples the next step's first draft, so a step
    checking d drafts costs d draft forwards (that one and d - 1 proposals), not d + 1; and that forward
    takes only the tokens without its K/V: the accepted drafts and the newest token (the step's first token
    was the last one's newest). One block holds the whole request here, so the newest always has a slot."""
    k = 3
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = generate(make_llm(target_dir, block_size=64), PROMPTS[:1], params)
    llm = with_draft(make_llm, target_dir, drafts[draft], k, block_size=64)
    forwards: list[int] = []  # the number of tokens each draft forward took
    llm.engine.draft_proposer.model.register_forward_hook(lambda _, args, __: forwards.append(len(args[0])))
    steps, schedule = [], llm.engine.scheduler.schedule

    def spy():
        before = len(forwards)  # the previous step's forwards end here (its follow included)
        output = schedule()
        steps.append((sum(len(item.draft_token_ids) for item in output.scheduled), before))
        return output

    llm.engine.scheduler.schedule = spy
    assert_same_outputs(expected, generate(llm, PROMPTS[:1], params))
    ends = [before for _, before in steps[1:]] + [len(forwards)]
    per_step = [(num_drafts, forwards[before:end]) for (num_drafts, before), end in zip(steps, ends)]
    assert len(per_step[0][1]) == 1  # the prefill: its follow forward samples the first draft
    assert all(len(step) == max(num_drafts, 1) for num_drafts, step in per_step), per_step
    assert all(step[:-1] == [1] * (len(step) - 1) for _, step in per_step)  # one-token proposals
    assert all(step[-1] <= num_drafts + 1 for num_drafts, step in per_step[1:])  # the follow
    if draft == "self":  # every draft accepted
        assert all(step[-1] == num_drafts + 1 for num_drafts, step in per_step[1:])
    assert sum(num_drafts for num_drafts, _ in per_step) >= len(per_step)  # it did speculate


@pytest.mark.parametrize("draft", ["self", "small", "int4-branches"])
def test_chunked_prefill_beside_speculating_decodes(make_llm, target_dir, drafts, draft):
    """The draft computes every prompt chunk with the target, so its cache is complete at the first decode."""
    prompts = [REPEATING[0], *PROMPTS[4:6], REPEATING[1]]
    arrivals = [0, 3, 5, 6]
    options = {"max_num_batched_tokens": 8}
    expected = run_staggered(make_llm(target_dir, **options), prompts, GREEDY, arrivals)
    llm = with_draft(make_llm, target_dir, drafts[draft], 3, **options)
    steps = record_steps(llm)
    assert_same_outputs(expected, run_staggered(llm, prompts, GREEDY, arrivals))
    assert any(any(d for d, _ in step) and any(not decode for _, decode in step) for step in steps)
    if draft == "self":
        assert_accepts_everything(llm)


def test_preemption_recomputes_the_drafts_cache_too(make_llm, target_dir, drafts):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    options = {"num_kv_blocks": 24}  # 96 slots for 5 requests that grow to ~45 tokens each
    expected = generate(make_llm(target_dir, **options), PROMPTS[:5], params)
    for draft in ("self", "small", "int4-branches"):
        llm = with_draft(make_llm, target_dir, drafts[draft], 3, **options)
        assert_same_outputs(expected, generate(llm, PROMPTS[:5], params))
        assert llm.engine.stats().num_preemptions > 0
        if draft == "self":
            assert_accepts_everything(llm)


def test_prefix_cache_hits_serve_the_drafts_cache_too(make_llm, target_dir, drafts):
    """A block another request computed holds the draft's K/V as well as the target's: a self-draft
    continuing from cached blocks still accepts every draft."""
    prompts = PROMPTS[:4]
    llm = with_draft(make_llm, target_dir, drafts["self"], 4)
    first = generate(llm, prompts, GREEDY)
    continued = [o.prompt_token_ids + o.outputs[0].token_ids[:17] for o in first]
    again = generate(llm, continued, GREEDY)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, prompts))
    assert_same_outputs(generate(make_llm(target_dir), continued, GREEDY), again)
    assert_accepts_everything(llm)


def test_n_samples(make_llm, target_dir, drafts):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = generate(make_llm(target_dir), PROMPTS[:2], params)
    for draft in ("self", "int8-self", "int4-branches"):
        llm = with_draft(make_llm, target_dir, drafts[draft], 4)
        assert_same_outputs(expected, generate(llm, PROMPTS[:2], params))
        assert spec_stats(llm).num_accepted_tokens > 0
        if draft == "self":  # samples after the first start from its cached prompt blocks, the draft's K/V too
            assert_accepts_everything(llm)


def test_penalties_bias_and_stops_apply_to_the_draft_as_to_the_target(make_llm, target_dir, drafts):
    """Greedy with penalties and bias: a self-draft that ignored them would be rejected; it accepts all."""
    llm = make_llm(target_dir)
    eos = llm.engine.eos_token_ids[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3,
                       logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, logit_bias={60: 3.0}),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=6, logit_bias={eos: 4.0}),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    expected = generate(llm, PROMPTS[:4], params)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)
    spec = with_draft(make_llm, target_dir, drafts["self"], 4)
    assert_same_outputs(expected, generate(spec, PROMPTS[:4], params))
    assert_accepts_everything(spec)
    # Alternatives: a kept one brings the logprobs of its own row.
    assert_same_outputs(expected, generate(with_draft(make_llm, target_dir, drafts["int4-branches"], 2),
                                           PROMPTS[:4], params))


def test_constrained_requests_draft_within_their_grammar(make_llm, target_dir, drafts):
    regex = StructuredOutputsParams(regex=r"(ab|cd|a b)+ end\.")
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 6}}, "required": ["tags"]})
    greedy = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
              SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=schema),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    expected = generate(make_llm(target_dir), PROMPTS[:3], greedy)
    for draft in ("self", "small"):
        llm = with_draft(make_llm, target_dir, drafts[draft], 4)
        assert_same_outputs(expected, generate(llm, PROMPTS[:3], greedy))
        if draft == "self":  # a draft that ignored the mask would be rejected where the mask bites
            assert_accepts_everything(llm)
    # Sampled under a grammar: every output is valid, and the grammar's matcher ends where it began.
    sampled = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=regex) for seed in range(6)]
    llm = with_draft(make_llm, target_dir, drafts["int8-self"], 4)
    completions = [output.outputs[0] for output in generate(llm, PROMPTS[:6], sampled)]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert stopped and all(re.fullmatch(regex.regex, c.text) for c in stopped)
    assert spec_stats(llm).num_accepted_tokens > 0


@pytest.mark.parametrize("draft", ["int8-self", "int4-branches"])
def test_seeded_sampling_is_a_function_of_seed_and_position(make_llm, target_dir, drafts, draft):
    """The same seeded request gives the same tokens alone and in a batch, and in another engine."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=20, ignore_eos=True) for seed in (1, 2)]
    batch = generate(with_draft(make_llm, target_dir, drafts[draft], 3), PROMPTS[:2], params)
    alone = generate(with_draft(make_llm, target_dir, drafts[draft], 3), PROMPTS[:1], params[:1])
    assert alone[0].outputs[0].token_ids == batch[0].outputs[0].token_ids


def test_metrics_count_model_drafts(make_llm, target_dir, drafts):
    llm = with_draft(make_llm, target_dir, drafts["self"], 2)
    generate(llm, PROMPTS[:2], GREEDY)
    stats = spec_stats(llm)
    text = ServerMetrics("m", llm.engine.stats).render().decode()
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(stats.num_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats.num_accepted_tokens)}' in text
    assert stats.num_accepted_tokens > 0


# --------------------------------------------------------------------------------------------------
# Start-up checks
# --------------------------------------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(make_llm, target_dir, checkpoint):
    bigger = checkpoint(ARCH, vocab_size=600)
    with pytest.raises(DraftMismatch, match="vocab size 600, the target's is 512"):
        make_llm(target_dir, speculative_config=draft_spec(bigger, 2))
    other_tokenizer = checkpoint(ARCH, tokenizer_seed=3)
    with pytest.raises(DraftMismatch, match="tokenizer's vocabulary differs"):
        make_llm(target_dir, speculative_config=draft_spec(other_tokenizer, 2))
    with pytest.raises(DraftMismatch, match="max_position_embeddings 64 is below max_model_len"):
        make_llm(target_dir, speculative_config=draft_spec(checkpoint(ARCH, max_position_embeddings=64), 2))


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "prompt_lookup_max cannot be used with method 'draft_model'"),
    ({"method": "ngram", "model": "d", "num_speculative_tokens": 2}, "model cannot be used with method 'ngram'"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "quantization": "fp4"},
     'quantization must be "int8"'),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "dtype": "fp7"}, "unknown dtype"),
    ({"method": "draft_model", "model": 3, "num_speculative_tokens": 2}, "model must be a string"),
    ({"method": "ngram", "num_speculative_tokens": 2, "first_token_candidates": 3},
     "first_token_candidates cannot be used with method 'ngram'"),
    ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "first_token_candidates": 0},
     "first_token_candidates must be positive"),
])
def test_bad_draft_model_configs_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(options)


def test_draft_dtype_is_its_own(make_llm, target_dir, drafts):
    llm = with_draft(make_llm, target_dir, {**drafts["self"], "dtype": "bfloat16"}, 2)
    assert llm.engine.draft_proposer.model.dtype == torch.bfloat16 and llm.engine.model.dtype == torch.float32
    expected = generate(make_llm(target_dir), PROMPTS[:2], GREEDY)
    assert_same_outputs(expected, generate(llm, PROMPTS[:2], GREEDY))


# --------------------------------------------------------------------------------------------------
# Sampled: the output follows the target's distribution
# --------------------------------------------------------------------------------------------------

TOP_K = 8
NUM_SAMPLES = 3000
P_VALUE_THRESHOLD = 1e-4


def chi_square(observed: Counter, expected: dict, total: int) -> tuple[float, float]:
    """Pearson's statistic and p-value; cells expecting fewer than 5 are pooled (with cells that expect
    nothing: a sample there is an outright failure of the rule)."""
    cells = set(observed) | set(expected)
    big = [c for c in cells if expected.get(c, 0.0) * total >= 5]
    rest_expected = sum(expected.get(c, 0.0) for c in cells if c not in big) * total
    rest_observed = sum(observed[c] for c in cells if c not in big)
    pairs = [(observed[c], expected[c] * total) for c in big] + [(rest_observed, max(rest_expected, 1e-9))]
    statistic = sum((o - e) ** 2 / e for o, e in pairs)
    df = len(pairs) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, p_value


def target_probs(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' next-token distribution after token_ids, at temperature 1 with top-k."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, -1].float()
    kth = logits.topk(TOP_K).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


class DraftSpy:
    """Records the draft model's proposals: what the naive rule (keep every draft) would output."""

    def __init__(self, proposer) -> None:
        self.proposer, self.proposed = proposer, {}

    def finished(self, request: Request) -> None:
        self.proposer.finished(request)

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        drafts = self.proposer.propose(requests)
        for request, draft in zip(requests, drafts):
            if draft.token_ids and request.num_output_tokens == 1:
                self.proposed[request.request_id] = draft.token_ids[0]
        return drafts


@pytest.mark.parametrize("candidates", [1, 3])
def test_sampled_output_follows_the_targets_distribution(make_llm, target_dir, checkpoint, monkeypatch, candidates):
    """The second output token is the first one checked against a draft (k = 1; the first comes from the
    prefill). Over NUM_SAMPLES seeds, the (first, second) pairs must follow p(first) * p(second | first),
    transformers' top-8 softmax. The draft (the target's weights at half the scale) agrees with the
    target about 30% of the time, so both acceptance and the residual draw matter; the naive rule fails.
    With 3 first-token candidates, some residual draws are alternatives, kept with the token after them."""
    kept_alternatives = spy_kept_alternatives(monkeypatch)
    draft_dir = checkpoint(ARCH, init_std=0.1)
    prompt = [0, 40, 41, 42, 43, 44, 45]
    llm = make_llm(target_dir, num_kv_blocks=1024, max_num_seqs=256,
                   speculative_config=draft_spec(draft_dir, 1, first_token_candidates=candidates))
    spy = DraftSpy(llm.engine.speculator.proposer)
    llm.engine.speculator.proposer = spy
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(NUM_SAMPLES)]
    outputs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    pairs = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    naive = Counter((o.outputs[0].token_ids[0], spy.proposed[o.request_id]) for o in outputs)
    assert len(spy.proposed) == NUM_SAMPLES  # every second token was checked against a draft

    first = target_probs(target_dir, prompt)
    expected = {}
    for token in first.nonzero()[:, 0].tolist():
        second = target_probs(target_dir, [*prompt, token])
        for next_token in second.nonzero()[:, 0].tolist():
            expected[(token, next_token)] = float(first[token] * second[next_token])
    statistic, p_value = chi_square(pairs, expected, NUM_SAMPLES)
    assert p_value > P_VALUE_THRESHOLD, f"chi-square {statistic:.1f}, p = {p_value:.2g}"
    stats = spec_stats(llm)
    assert 0.1 * NUM_SAMPLES < stats.num_accepted_tokens < 0.9 * NUM_SAMPLES  # both branches taken
    naive_statistic, naive_p = chi_square(naive, expected, NUM_SAMPLES)
    assert naive_p < 1e-30 and naive_statistic > 10 * statistic
    assert any(kept_alternatives) == (candidates > 1)


def test_rejection_sampling_rows_against_known_distributions():
    """The sampler alone: p and q given, the kept token over many seeds is distributed as p."""
    vocab = 6
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -9.0])
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    draws = Counter()
    for seed in range(4000):
        request = Request(request_id=str(seed), prompt_token_ids=[1], seed=seed,
                          params=SamplingParams(temperature=1.0, max_tokens=4), max_model_len=64)
        draft = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed + 10**6)))
        row = SampleRow(request, (), Proposal(draft, q))
        draws[sample(p_logits[None], build_sampling_metadata([row], vocab)).token_ids[0]] += 1
    p = p_logits.softmax(-1)
    _, p_value = chi_square(draws, {i: float(p[i]) for i in range(vocab)}, 4000)
    assert p_value > P_VALUE_THRESHOLD


def test_served_with_a_draft_model(tmp_path, make_llm):
    """`pagoda serve --speculative-config` with a draft (its own int4 copy, 4 first-token candidates, so that
    steps reject, keep alternatives and roll back): same text as offline without, streamed or not, and
    acceptance in /metrics."""
    from server_fixtures import make_server_checkpoint, start_server

    model_dir = make_server_checkpoint(tmp_path / "model")
    spec = draft_spec(model_dir, 3, quantization="int4", first_token_candidates=4)
    server = start_server(model_dir, tmp_path, "--num-kv-blocks", "128", "--block-size", "4",
                          "--speculative-config", json.dumps(spec), served_model_name="m")
    try:
        with server.client() as client:
            request = {"model": "m", "prompt": REPEATING[0], "max_tokens": 20, "temperature": 0.0}
            whole = client.completions.create(**request)
            chunks = list(client.completions.create(**request, stream=True))
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
        expected = generate(make_llm(model_dir), [REPEATING[0]], SamplingParams(temperature=0.0, max_tokens=20))
        assert whole.choices[0].text == expected[0].outputs[0].text
        metrics = server.wait_until_idle()
        accepted = metrics.value("vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < metrics.value("vllm:spec_decode_num_draft_tokens_total")
    finally:
        server.stop()


def test_draft_model_config_is_the_same_from_every_surface(target_dir):
    from test_config_surfaces import spec_from_every_surface

    options = draft_spec(target_dir, 3, quantization="int8", dtype="bfloat16", first_token_candidates=3)
    for config in spec_from_every_surface(options):
        assert config == SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(target_dir),
                                           quantization="int8", dtype="bfloat16", first_token_candidates=3)
        assert config.prompt_lookup_min is None and config.prompt_lookup_max is None
