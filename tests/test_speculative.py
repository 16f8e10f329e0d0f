"""Speculative decoding (n-gram prompt lookup) never changes what the model outputs.

End to end, the same requests run on an engine with speculation and on one without, and must give the same
completions token for token (greedy and seeded; text, finish and stop reasons, logprobs): with k = 1..5,
under batching with requests that do not speculate, chunked prefill, preemption, prefix-cache hits, n > 1,
penalties, stop conditions and structured outputs, and speculation must really happen (drafts accepted).
An oracle proposer, which drafts the known answer (now and then wrong on purpose), makes long accepted runs
that cross stops and block boundaries. Without a model: the n-gram lookup, the acceptance rule, the
scheduler's draft slots and the KV manager's rollback.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import random_prompts
from reference_kernels import ReferenceKernels
from server_fixtures import make_server_checkpoint, start_server

import pagoda.kernels
from pagoda import SamplingParams
from pagoda.config import SchedulerConfig, SpeculativeConfig
from pagoda.engine.api import EngineStats, RequestOutput, SpecDecodeStats
from pagoda.engine.core.drafts import Draft, draft_room
from pagoda.engine.core.kv_cache import KVCacheManager, hash_block
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.scheduler import Scheduler
from pagoda.engine.core.speculative import Speculator, accept_drafts, accepted_rows, ngram_lookup
from pagoda.engine.sampler import SampleRow, build_sampling_metadata
from pagoda.model.attention import build_metadata
from pagoda.server.metrics import ServerMetrics
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.interface import GrammarStateError

ARCH = "llama"
VOCAB = 512
BLOCK_SIZE = 4
REPEATING = [[31, 32, 33, 34] * 4, [50, 51, 52] * 3 + [50], [7, 8] * 6]
PROMPTS = REPEATING + random_prompts([3, 9, 21], seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def ngram(k: int, **options: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4, **options}


@pytest.fixture(scope="module")
def repetitive_dir(checkpoint) -> Path:
    """Weights at std 0.1: greedy output falls into loops, so n-gram drafts are often right."""
    return checkpoint(ARCH, init_std=0.1)


@pytest.fixture(scope="module")
def random_dir(checkpoint) -> Path:
    return checkpoint(ARCH)


@pytest.fixture(params=["repetitive", "random"])
def model_dir(request, repetitive_dir, random_dir) -> Path:
    return repetitive_dir if request.param == "repetitive" else random_dir


def generate(llm, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


def assert_same_outputs(expected: list[RequestOutput], actual: list[RequestOutput]) -> None:
    """Token for token, text, finish and stop reasons; logprobs to a float tolerance (each position is
    computed as its decode would be, but in a batch of another size)."""
    assert len(actual) == len(expected)
    for want_output, got_output in zip(expected, actual):
        assert len(got_output.outputs) == len(want_output.outputs)
        for want, got in zip(want_output.outputs, got_output.outputs):
            assert got.token_ids == want.token_ids, f"prompt {want_output.prompt_token_ids}"
            assert (got.text, got.finish_reason, got.stop_reason) == (want.text, want.finish_reason, want.stop_reason)
            assert (got.logprobs is None) == (want.logprobs is None)
            for got_row, want_row in zip(got.logprobs or [], want.logprobs or []):
                assert got_row.keys() == want_row.keys()
                assert got_row == pytest.approx(want_row, abs=1e-4)


def record_steps(llm) -> list[list[tuple[int, bool]]]:
    """Spies on the scheduler: per step, (drafts, is a decode) for each scheduled request."""
    steps: list[list[tuple[int, bool]]] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        output = schedule()
        steps.append([(len(item.draft_token_ids), item.is_decode) for item in output.scheduled])
        return output

    llm.engine.scheduler.schedule = spy
    return steps


def spec_stats(llm) -> SpecDecodeStats:
    stats = llm.engine.stats().spec_decode
    assert stats is not None
    return stats


class OracleProposer:
    """Drafts the known answer: the next tokens of a reference completion, with every `wrong_every`-th draft's
    last token made wrong, so that steps both accept everything and reject part way."""

    def __init__(self, outputs: list[RequestOutput], k: int, wrong_every: int = 3) -> None:
        self.answers = {(tuple(o.prompt_token_ids), c.index): list(c.token_ids) for o in outputs for c in o.outputs}
        self.k = k
        self.wrong_every = wrong_every
        self.num_proposed = 0

    def finished(self, request: Request) -> None:
        pass

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        drafts = []
        for request in requests:
            answer = self.answers[(tuple(request.prompt_token_ids), request.sample_index)]
            start = request.num_output_tokens
            draft = answer[start : start + draft_room(request, self.k)]
            self.num_proposed += 1
            if draft and self.num_proposed % self.wrong_every == 0:
                draft[-1] = (draft[-1] + 1) % VOCAB
            drafts.append(Draft(draft))
        return drafts


def with_oracle(make_llm, model_dir: Path, answers: list[RequestOutput], k: int, **options):
    llm = make_llm(model_dir, speculative_config=ngram(k), **options)
    llm.engine.speculator.proposer = OracleProposer(answers, k)
    return llm


# --------------------------------------------------------------------------------------------------
# End to end: equal to decoding without speculation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_output_is_unchanged_for_every_k_in_batches_with_requests_that_do_not_speculate(
    make_llm, model_dir, repetitive_dir, k
):
    # max_tokens 1 and 2 leave no room for drafts: those requests decode one token a step beside the others.
    params = [GREEDY] * len(PROMPTS) + [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2)]
    prompts = PROMPTS + REPEATING[:2]
    expected = generate(make_llm(model_dir), prompts, params)
    llm = make_llm(model_dir, speculative_config=ngram(k))
    steps = record_steps(llm)
    assert_same_outputs(expected, generate(llm, prompts, params))
    stats = spec_stats(llm)
    assert stats.num_drafts > 0 and len(stats.accepted_per_position) == k
    assert any(any(d for d, _ in step) and any(not d and decode for d, decode in step) for step in steps)
    if model_dir == repetitive_dir:
        assert stats.num_accepted_tokens > 0 and any(sum(d for d, _ in step) > 1 for step in steps)


@pytest.mark.parametrize("k", [2, 5])
def test_an_oracle_that_is_mostly_right_gives_long_runs_and_the_same_output(make_llm, random_dir, k):
    expected = generate(make_llm(random_dir), PROMPTS, GREEDY)
    llm = with_oracle(make_llm, random_dir, expected, k)
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    stats = spec_stats(llm)
    # Two drafts in three are all right; the third is wrong in its last token only.
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    assert stats.accepted_per_position[k - 1] > 0


@pytest.mark.parametrize("arch", ["mistral", "qwen2-swa", "qwen3", "llama-mqa"])
def test_other_architectures_and_sliding_windows(make_llm, checkpoint, arch):
    """A speculative query attends through the prefill path's masks: windows must hold there too."""
    model_dir = checkpoint(arch)
    expected = generate(make_llm(model_dir), PROMPTS, GREEDY)
    llm = with_oracle(make_llm, model_dir, expected, 5)
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_same_outputs(expected, generate(make_llm(model_dir, speculative_config=ngram(3)), PROMPTS, GREEDY))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_output_is_unchanged(make_llm, checkpoint, arch):
    """bf16 rounds differently on the prefill and decode attention paths: each checked position must take
    the decode path, as it would without speculation."""
    model_dir = checkpoint(arch)
    expected = generate(make_llm(model_dir, dtype="bfloat16"), PROMPTS, GREEDY)
    llm = with_oracle(make_llm, model_dir, expected, 4, dtype="bfloat16")
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    assert spec_stats(llm).num_accepted_tokens > 0


class RowCountingStack:
    """Wraps a native decode stack, recording how many token rows each step it ran had."""

    def __init__(self, stack) -> None:
        self.stack, self.rows = stack, []

    def forward(self, x, *args):
        self.rows.append(x.shape[0])
        return self.stack.forward(x, *args)


def test_the_native_decode_stack_runs_speculative_steps(make_llm, random_dir, monkeypatch):
    """With the kernels (their torch stand-ins here), a decode-only step with drafts is still decode rows
    only, so the native decode stack takes it whole."""
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", ReferenceKernels)
    expected = generate(make_llm(random_dir), PROMPTS, GREEDY)
    llm = with_oracle(make_llm, random_dir, expected, 4)
    runner = llm.engine.model.backend.decode_runner
    assert runner is not None
    runner.stack = RowCountingStack(runner.stack)
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    assert max(runner.stack.rows) > len(PROMPTS)  # more rows than requests: drafts went through the stack


def run_staggered(llm, prompts: list, params: SamplingParams, arrivals: list[int]) -> list[RequestOutput]:
    """Adds prompt i at step arrivals[i] (so prefills meet decodes), steps to the end, outputs in prompt order."""
    engine, finished, step = llm.engine, {}, 0
    while len(finished) < len(prompts):
        for index, arrival in enumerate(arrivals):
            if arrival == step:
                engine.add_request(f"r{index}", prompts[index], params)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return [finished[f"r{index}"] for index in range(len(prompts))]


def test_chunked_prefill_beside_speculating_decodes(make_llm, model_dir):
    prompts = [REPEATING[0], *random_prompts([37, 23], seed=9), REPEATING[1]]
    arrivals = [0, 3, 5, 6]
    options = {"max_num_batched_tokens": 8}  # prompts go in chunks; drafts get what the decodes leave
    expected = run_staggered(make_llm(model_dir, **options), prompts, GREEDY, arrivals)
    llm = make_llm(model_dir, speculative_config=ngram(4), **options)
    steps = record_steps(llm)
    assert_same_outputs(expected, run_staggered(llm, prompts, GREEDY, arrivals))
    assert any(any(d for d, _ in step) and any(not decode for _, decode in step) for step in steps)
    assert all(sum(d for d, _ in step) + len(step) <= 8 for step in steps)


def test_preemption_and_recompute(make_llm, repetitive_dir, random_dir):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    options = {"num_kv_blocks": 24}  # 96 slots for 5 requests that grow to ~45 tokens each
    for model_dir in (repetitive_dir, random_dir):
        expected = generate(make_llm(model_dir, **options), PROMPTS[:5], params)
        llm = make_llm(model_dir, speculative_config=ngram(3), **options)
        assert_same_outputs(expected, generate(llm, PROMPTS[:5], params))
        assert llm.engine.stats().num_preemptions > 0


def full_block_hashes(sequences: list[list[int]]) -> set[bytes]:
    """Every full block's chained hash along each real token sequence (no cache salt)."""
    hashes = set()
    for tokens in sequences:
        parent = None
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash_block(parent, tokens[start : start + BLOCK_SIZE])
            hashes.add(parent)
    return hashes


def test_prefix_cache_holds_only_accepted_tokens_and_serves_continuations(make_llm, repetitive_dir):
    prompts = PROMPTS[:4]
    llm = make_llm(repetitive_dir, speculative_config=ngram(4))
    first = generate(llm, prompts, GREEDY)
    assert spec_stats(llm).num_accepted_tokens > 0
    # Every cached block is a block of a real prompt + output: no draft ever reached a block hash.
    real = [o.prompt_token_ids + o.outputs[0].token_ids for o in first]
    assert set(llm.engine.kv_cache.pool.cached) <= full_block_hashes(real)
    # Continuations hit blocks that hold generated tokens, and still decode as without speculation.
    continued = [tokens[: len(prompt) + 17] for tokens, prompt in zip(real, prompts)]
    again = generate(llm, continued, GREEDY)
    assert all(o.num_cached_tokens > len(p) for o, p in zip(again, prompts))
    assert_same_outputs(generate(make_llm(repetitive_dir), continued, GREEDY), again)


def test_n_samples_and_seeded_sampling(make_llm, model_dir):
    params = [
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=24, ignore_eos=True),  # engine-drawn seed
        SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    prompts = PROMPTS[:4]
    expected = generate(make_llm(model_dir), prompts, params)
    llm = make_llm(model_dir, speculative_config=ngram(3))
    assert_same_outputs(expected, generate(llm, prompts, params))
    oracle = with_oracle(make_llm, model_dir, expected, 3)
    assert_same_outputs(expected, generate(oracle, prompts, params))
    assert spec_stats(oracle).num_accepted_tokens > 0


def penalty_params(eos: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=0.4,
                       frequency_penalty=0.3, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, logprobs=0),
        SamplingParams(temperature=0.9, seed=5, max_tokens=30, ignore_eos=True, logit_bias={60: 4.0, 61: -50.0},
                       frequency_penalty=0.5, logprobs=2),
        # EOS made likely, but banned until min_tokens: a run that reaches EOS must stop there.
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6, logit_bias={eos: 4.0}, logprobs=1),
    ]


def test_penalties_bias_min_tokens_and_logprobs(make_llm, model_dir):
    prompts = PROMPTS[:4]
    llm = make_llm(model_dir)
    params = penalty_params(llm.engine.eos_token_ids[0])
    expected = generate(llm, prompts, params)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)
    assert_same_outputs(expected, generate(make_llm(model_dir, speculative_config=ngram(4)), prompts, params))
    # Drafts from a run that ignores eos and min_tokens go past where these requests stop.
    answers = generate(make_llm(model_dir), prompts,
                       [dataclasses.replace(p, ignore_eos=True, min_tokens=0) for p in params])
    oracle = with_oracle(make_llm, model_dir, answers, 4)
    assert_same_outputs(expected, generate(oracle, prompts, params))
    assert spec_stats(oracle).num_accepted_tokens > 0


def test_stop_strings_stop_tokens_and_max_tokens_inside_an_accepted_run(make_llm, random_dir):
    prompts = PROMPTS[3:6]
    plain = make_llm(random_dir)
    long_run = generate(plain, prompts, GREEDY)
    stop_string = plain.get_tokenizer().decode(long_run[0].outputs[0].token_ids[9:11])  # two middle tokens' text
    assert stop_string.strip()
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop_string]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                       stop_token_ids=[long_run[1].outputs[0].token_ids[12]]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    expected = generate(plain, prompts, params)
    assert [o.outputs[0].finish_reason for o in expected] == ["stop", "stop", "length"]
    for wrong_every in (3, 1000):  # some steps reject; or nearly every draft is right
        llm = with_oracle(make_llm, random_dir, long_run, 5)
        llm.engine.speculator.proposer.wrong_every = wrong_every
        assert_same_outputs(expected, generate(llm, prompts, params))
        assert spec_stats(llm).num_accepted_tokens > 0


def test_constrained_requests_speculate_within_their_grammar(make_llm, model_dir):
    regex = StructuredOutputsParams(regex=r"(ab|cd|a b)+ end\.")
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 6}}, "required": ["tags"]})
    # Unconstrained requests first and between: constrained rows are not the batch's first rows.
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs=regex),
        SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=60, structured_outputs=schema, logprobs=1),
    ]
    prompts = PROMPTS[:5]
    expected = generate(make_llm(model_dir), prompts, params)
    for output, p in zip(expected, params):  # the masks held (an output cut by max_tokens is a prefix)
        completion = output.outputs[0]
        if p.structured_outputs is regex and completion.finish_reason == "stop":
            assert re.fullmatch(regex.regex, completion.text)
        if p.structured_outputs is schema and completion.finish_reason == "stop":
            assert set(json.loads(completion.text)["tags"]) <= {"x", "yz"}
    llm = make_llm(model_dir, speculative_config=ngram(4))
    assert_same_outputs(expected, generate(llm, prompts, params))
    oracle = with_oracle(make_llm, model_dir, expected, 4)
    assert_same_outputs(expected, generate(oracle, prompts, params))
    assert spec_stats(oracle).num_accepted_tokens > 0


def test_a_step_that_accepts_drafts_streams_them_as_one_output(make_llm, random_dir):
    expected = generate(make_llm(random_dir), PROMPTS[:1], GREEDY)
    engine = with_oracle(make_llm, random_dir, expected, 4).engine
    engine.add_request("one", PROMPTS[0], GREEDY)
    seen: list[int] = []
    step_sizes = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            token_ids = output.outputs[0].token_ids
            assert token_ids[: len(seen)] == seen  # cumulative
            step_sizes.append(len(token_ids) - len(seen))
            seen = list(token_ids)
    assert seen == expected[0].outputs[0].token_ids
    assert max(step_sizes) == 5 and min(step_sizes) >= 1


def test_disable_by_batch_size_turns_drafts_off_for_big_batches(make_llm, repetitive_dir):
    llm = make_llm(repetitive_dir, speculative_config=ngram(3, disable_by_batch_size=2))
    steps = record_steps(llm)
    expected = generate(make_llm(repetitive_dir), PROMPTS, GREEDY)
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    assert all(not any(d for d, _ in step) for step in steps if len(step) > 2)
    generate(llm, PROMPTS[:1], GREEDY)
    assert spec_stats(llm).num_drafts > 0  # alone, it speculates


def test_served_with_the_flag_streams_the_same_text_and_counts_every_token(tmp_path, make_llm):
    """`pagoda serve --speculative-config`: a streamed completion equals the non-streamed one and the
    offline engine without speculation; usage counts every token; /metrics shows the acceptance."""
    model_dir = make_server_checkpoint(tmp_path / "model", init_std=0.1)
    server = start_server(model_dir, tmp_path, "--num-kv-blocks", "128", "--block-size", str(BLOCK_SIZE),
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_max": 3}', served_model_name="m")
    try:
        with server.client() as client:
            request = {"model": "m", "prompt": REPEATING[0], "max_tokens": 40, "temperature": 0.0}
            whole = client.completions.create(**request)
            chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == whole.choices[0].text
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 40
        expected = generate(make_llm(model_dir), [REPEATING[0]], SamplingParams(temperature=0.0, max_tokens=40))
        assert whole.choices[0].text == expected[0].outputs[0].text
        metrics = server.wait_until_idle()
        assert metrics.value("vllm:spec_decode_num_accepted_tokens_total") > 0
        assert metrics.value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        assert metrics.value("vllm:generation_tokens_total") == 80
    finally:
        server.stop()


def test_metrics_report_vllms_spec_decode_counters_only_when_configured():
    stats = EngineStats(spec_decode=SpecDecodeStats(5, 12, 7, (4, 2, 1)))
    text = ServerMetrics("m", lambda: stats).render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 5.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'):
        assert line in text
    assert "spec_decode" not in ServerMetrics("m", EngineStats).render().decode()


# --------------------------------------------------------------------------------------------------
# Without a model: lookup, acceptance, sampling rows, scheduler and KV manager
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "min_n", "max_n", "k", "drafts"), [
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # [4, 2, 3] never recurs; [2, 3] does, with 3 tokens after it
    ([1, 2, 3, 4, 2, 3], 1, 1, 4, [4, 2, 3]),  # n = 1: the earliest 3
    ([9, 1, 2, 7, 5, 1, 2, 8, 1, 2], 2, 2, 2, [7, 5]),  # the earliest of two occurrences
    ([5, 1, 2, 6, 7, 2, 6, 1, 2], 1, 2, 3, [6, 7, 2]),  # the longest n wins over later, shorter ones
    ([3, 3, 3, 3], 2, 2, 5, [3, 3]),  # an occurrence may overlap the suffix
    ([1, 2, 3, 4], 1, 3, 4, []),  # no earlier occurrence
    ([1, 2, 1, 2], 1, 2, 0, []),  # no room
    ([1, 2, 1, 2], 3, 4, 2, []),  # n-grams longer than the history can hold
    ([256, 1, 0, 0, 256], 1, 1, 2, [1, 0]),  # ids whose bytes straddle token boundaries match only aligned
    ([1], 1, 4, 3, []),
])
def test_ngram_lookup(tokens, min_n, max_n, k, drafts):
    assert ngram_lookup(tokens, min_n, max_n, k) == drafts


def test_accept_drafts_keeps_the_targets_tokens_up_to_the_first_mismatch():
    assert accept_drafts([], [9]) == [9]
    assert accept_drafts([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all right: plus the bonus token
    assert accept_drafts([4, 5, 6], [4, 8, 6, 7]) == [4, 8]
    assert accept_drafts([4, 5, 6], [1, 5, 6, 7]) == [1]


def test_accepted_rows_take_an_alternative_only_where_the_first_draft_fails():
    # rows: the known token, drafts 4 5 6 (targets 1-3, bonus), alternatives 7 8 (the target's token after each)
    assert accepted_rows([4, 5, 6], [7, 8], [4, 5, 9, 9, 50, 51]) == [0, 1, 2]  # the chain's run
    assert accepted_rows([4, 5, 6], [7, 8], [8, 5, 6, 9, 50, 51]) == [0, 5]  # 8 kept, then its own next token
    assert accepted_rows([4, 5, 6], [7, 8], [3, 5, 6, 9, 50, 51]) == [0]  # no guess was right
    assert accepted_rows([4], [], [3, 9]) == [0]


def test_a_branch_attends_to_the_keys_before_it_and_its_own_slot():
    """The alternative after a 2-draft chain stands at the first draft's position, writes its K/V to the
    slot allocated past the chain and sees the known tokens and itself, not the drafts."""
    block_size, table = 4, [5, 2]  # positions 0-3 in block 5, 4-7 in block 2
    # A request with 3 computed tokens: the known token at position 3, drafts at 4 and 5, the branch at 4
    # whose slot is position 6's.
    branch_slot = 2 * block_size + 2
    meta = build_metadata([1, 1, 1, 1], [4, 5, 6, 5], [table] * 4, block_size, {None}, {3: branch_slot})
    assert meta.positions.tolist() == [3, 4, 5, 4]
    assert meta.slot_mapping.tolist() == [23, 8, 9, branch_slot]
    assert meta.decode_seq_lens.tolist() == [4, 5, 6, 5]
    assert meta.decode_key_slots[3, :5].tolist() == [20, 21, 22, 23, branch_slot]
    assert meta.decode_key_slots[1, :5].tolist() == [20, 21, 22, 23, 8]


def make_request(request_id: str, prompt: list[int], max_tokens: int = 32, **params) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt),
                   params=SamplingParams(max_tokens=max_tokens, **params), seed=1, max_model_len=1024)


def test_a_sample_row_sees_the_drafts_before_it_as_output():
    params = {"temperature": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 3}
    request = make_request("a", [5, 6, 7], **params)
    request.append_token(9)
    as_drafts = build_sampling_metadata([SampleRow(request, [10, 11])], 32)
    request.append_token(10)
    request.append_token(11)
    as_output = build_sampling_metadata([request], 32)
    assert as_drafts.draw_seeds == as_output.draw_seeds
    assert as_drafts.penalties is not None and as_output.penalties is not None
    for name in ("output_counts", "seen", "bias"):
        assert getattr(as_drafts.penalties, name).equal(getattr(as_output.penalties, name))


class StepDrafts:
    """A draft source handing the scheduler what the test set for the next step."""

    def __init__(self) -> None:
        self.next: dict[str, list[int]] = {}

    def drafts(self, running: Sequence[Request]) -> dict[str, Draft]:
        drafts, self.next = self.next, {}
        return {request_id: Draft(tokens) for request_id, tokens in drafts.items()}

    def finished(self, request: Request) -> None:
        pass


def make_scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=1024)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE), StepDrafts())


def schedule_with(scheduler: Scheduler, drafts: dict[str, list[int]]):
    scheduler.draft_source.next = drafts
    return scheduler.schedule()


def decoding(scheduler: Scheduler, request: Request, first_token: int = 1) -> Request:
    """Admits a request, computes its prompt and samples its first token: its next step is a decode."""
    scheduler.add_request(request)
    output = scheduler.schedule()
    sampled = {item.request.request_id: [first_token] for item in output.scheduled if item.samples}
    scheduler.update(output, ModelRunnerOutput(sampled))
    assert request.num_computed_tokens == request.num_tokens - 1
    return request


def test_drafts_take_what_the_running_requests_leave_of_the_budget():
    scheduler = make_scheduler(budget=7)
    a, _ = (decoding(scheduler, make_request(name, [20 + i for i in range(6)])) for name in "ab")
    output = schedule_with(scheduler, {"a": [1, 2, 3, 4, 5, 6], "b": [1, 2]})
    # Each decode costs 1; a's drafts take the 5 left, b gets none.
    assert [(item.request.request_id, item.num_tokens, item.draft_token_ids) for item in output.scheduled] == [
        ("a", 6, [1, 2, 3, 4, 5]), ("b", 1, [])]
    assert output.scheduled[0].input_token_ids() == [1, 1, 2, 3, 4, 5]  # a's last token, then the drafts
    assert len(a.block_ids) * BLOCK_SIZE >= a.num_computed_tokens + 6


def test_drafts_never_preempt_a_request():
    scheduler = make_scheduler(num_blocks=3)
    decoding(scheduler, make_request("a", list(range(10, 16))))
    decoding(scheduler, make_request("b", [40, 41, 42]))
    assert scheduler.kv_cache.num_free_blocks == 0  # each decode fits its last block; no draft would
    output = schedule_with(scheduler, {"a": [1, 2, 3], "b": [1]})
    assert [(item.request.request_id, item.num_tokens) for item in output.scheduled] == [("a", 1), ("b", 1)]
    assert not output.preempted


def test_update_keeps_the_accepted_run_and_rolls_back_the_rest_across_blocks():
    scheduler = make_scheduler(num_blocks=16)
    kv = scheduler.kv_cache
    request = decoding(scheduler, make_request("a", list(range(100, 107))))  # 8 tokens, 7 computed
    free_before = kv.num_free_blocks
    output = schedule_with(scheduler, {"a": [2, 3, 4, 5, 6, 7, 8, 9]})  # slots 7..15: two more blocks
    assert output.scheduled[0].num_tokens == 9 and kv.num_free_blocks == free_before - 2
    # The target agreed with the first two drafts, then differed: the runner gives the 3 tokens kept.
    [advanced] = scheduler.update(output, ModelRunnerOutput({"a": [2, 3, 40]}))
    assert advanced.request is request and advanced.new_token_ids == [2, 3, 40]
    assert request.output_token_ids == [1, 2, 3, 40] and request.num_computed_tokens == 10
    assert len(request.block_ids) == 3 and kv.num_free_blocks == free_before - 1  # 11 tokens: 3 blocks
    kv.check_invariants()
    # Only blocks full of computed, kept tokens are cached: none holds a rejected draft.
    assert set(kv.pool.cached) == full_block_hashes([request.all_token_ids[:8]])
    assert scheduler.spec_decode.snapshot(8) == SpecDecodeStats(1, 8, 2, (1, 1, 0, 0, 0, 0, 0, 0))


def test_a_stop_inside_the_accepted_run_ends_the_request_there():
    scheduler = make_scheduler()
    request = decoding(scheduler, make_request("a", [5, 6, 7], stop_token_ids=[3]))
    output = schedule_with(scheduler, {"a": [2, 3, 4]})
    [advanced] = scheduler.update(output, ModelRunnerOutput({"a": [2, 3, 4, 5]}))  # all accepted, and the bonus
    assert advanced.request is request and advanced.new_token_ids == [2, 3]  # cut at the stop, before appending
    assert request.output_token_ids == [1, 2, 3] and request.finish_reason == FinishReason.STOP
    assert request.stop_reason == 3 and scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks

    request = decoding(scheduler, make_request("b", [5, 6, 7], max_tokens=3))
    output = schedule_with(scheduler, {"b": [8, 9, 10]})
    assert output.scheduled[0].draft_token_ids == [8, 9, 10]  # the scheduler checks room only through drafts given
    scheduler.update(output, ModelRunnerOutput({"b": [8, 9, 10, 11]}))
    assert request.output_token_ids == [1, 8, 9] and request.finish_reason == FinishReason.LENGTH


class EndingGrammar:
    """A matcher that refuses `refused` and ends once it has accepted `ends_after` tokens."""

    def __init__(self, ends_after: int, refused: int | None = None) -> None:
        self.ends_after, self.refused = ends_after, refused
        self.accepted: list[int] = []

    def accept_tokens(self, tokens: list[int]) -> bool:
        if self.refused in tokens:
            return False
        self.accepted += tokens
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.ends_after


def test_the_grammars_end_inside_the_accepted_run_ends_it_before_the_rest_is_appended():
    scheduler = make_scheduler()
    request = decoding(scheduler, make_request("a", [5, 6, 7]))
    request.grammar = EndingGrammar(ends_after=2)
    output = schedule_with(scheduler, {"a": [2, 3, 4]})
    [advanced] = scheduler.update(output, ModelRunnerOutput({"a": [2, 3, 4, 5]}))
    assert advanced.new_token_ids == [2, 3] and request.output_token_ids == [1, 2, 3]
    assert request.grammar.accepted == [2, 3]  # advanced only by tokens appended
    assert request.finish_reason == FinishReason.STOP and request.stop_reason is None
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_request_that_fails_in_the_step_gets_its_error_and_no_tokens():
    scheduler = make_scheduler()
    refusing = decoding(scheduler, make_request("g", [5, 6, 7]))
    refusing.grammar = EndingGrammar(ends_after=10, refused=3)
    failing = decoding(scheduler, make_request("f", [5, 6, 7]))
    plain = decoding(scheduler, make_request("p", [5, 6, 7]))
    before = {request.request_id: list(request.output_token_ids) for request in (refusing, failing, plain)}
    output = schedule_with(scheduler, {"g": [2, 3, 4]})
    runner_error = RuntimeError("its sampler row failed")
    results = scheduler.update(output, ModelRunnerOutput({"g": [2, 3, 4, 5], "p": [8]}, failures={"f": runner_error}))
    by_id = {result.request.request_id: result for result in results}
    assert isinstance(by_id["g"].error, GrammarStateError) and by_id["g"].new_token_ids == []
    assert by_id["f"].error is runner_error and failing.output_token_ids == before["f"]
    assert by_id["p"].error is None and by_id["p"].new_token_ids == [8] and plain.output_token_ids == [*before["p"], 8]
    # The engine fails the groups of the failed ones (and frees them); the scheduler has not finished them.
    assert not refusing.is_finished and not failing.is_finished


class FakeGrammar:
    def __init__(self, num_valid: int) -> None:
        self.num_valid = num_valid

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        return min(self.num_valid, len(tokens))


class FixedProposer:
    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.asked: list[str] = []

    def finished(self, request: Request) -> None:
        pass

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        self.asked += [r.request_id for r in requests]
        return [Draft(list(self.draft)) for _ in requests]


def test_the_speculator_drafts_for_decodes_within_room_and_grammar():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=3)
    proposer = FixedProposer([1, 2, 3, 4, 5, 6])
    speculator = Speculator(config, proposer)
    prefilling = make_request("p", [5, 6, 7])
    short = make_request("s", [5, 6, 7], max_tokens=3)  # 1 of 3 out: room for 1 draft (the target adds one)
    constrained = make_request("g", [5, 6, 7])
    constrained.grammar = FakeGrammar(2)
    plain = make_request("x", [5, 6, 7])
    for request in (short, constrained, plain):
        request.append_token(9)
        request.num_computed_tokens = request.num_tokens - 1
    assert speculator.drafts([prefilling, short, constrained, plain]) == {}  # 4 running > 3
    drafts = speculator.drafts([prefilling, short, constrained])
    assert drafts == {"s": Draft([1]), "g": Draft([1, 2])} and "p" not in proposer.asked
    assert speculator.drafts([plain]) == {"x": Draft([1, 2, 3, 4])}  # at most k


def test_kv_rollback_frees_the_surplus_blocks_first_in_line():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10, 16)))  # 6 tokens
    assert kv.allocate_slots(request, 6) is not None
    request.num_computed_tokens = 6
    assert kv.allocate_slots(request, 1 + 9) is not None  # a decode and 9 drafts: slots up to 15 -> 4 blocks
    assert len(request.block_ids) == 4 and kv.num_free_blocks == 6
    surplus = request.block_ids[2:]
    kv.rollback(request, 8)  # 8 tokens known: 2 blocks hold them
    assert len(request.block_ids) == 2 and kv.num_free_blocks == 8
    assert set(list(kv.pool.free_queue)[:2]) == set(surplus)  # taken again before any cached block
    kv.check_invariants()
    kv.rollback(request, 8)  # nothing more to free
    assert kv.num_free_blocks == 8
    request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    kv.free(request)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_kv_rollback_never_frees_a_cached_block():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10, 19)))  # 9 tokens: 2 full blocks once computed
    assert kv.allocate_slots(request, 9) is not None
    request.num_computed_tokens = 9
    kv.cache_full_blocks(request)
    with pytest.raises(AssertionError, match="cached block"):
        kv.rollback(request, 4)
