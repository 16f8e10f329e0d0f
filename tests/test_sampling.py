"""Sampling: seeded reproducibility whatever the batch, the sampler's distribution, logprobs against
`transformers`, and the stop / length / penalty knobs."""

from __future__ import annotations

import pytest
import torch
from conftest import compare_with_reference, random_prompts

from pagoda import SamplingParams
from pagoda.engine.core.request import Request
from pagoda.engine.sampler import _draw_seed, build_sampling_metadata, sample

ARCH = "qwen2"  # tied embeddings: greedy output repeats tokens, which the penalty tests need
EOS = 1
PROMPTS = random_prompts([3, 9, 14, 20, 6, 11], seed=5)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def llm(model_dir):
    from pagoda import LLM

    return LLM(str(model_dir), num_kv_blocks=256, block_size=4)


def generate(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def token_ids(llm, prompts, params) -> list[list[int]]:
    return [completion.token_ids for completion in generate(llm, prompts, params)]


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def seeded(seed: int, max_tokens: int = 12, temperature: float = 1.0, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kwargs)


# --------------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------------


def test_same_seed_same_tokens_whatever_the_batch(llm):
    params = [seeded(100 + i, top_k=50 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0) for i in range(len(PROMPTS))]
    alone = [token_ids(llm, [prompt], p)[0] for prompt, p in zip(PROMPTS, params)]
    # The same requests, batched with unseeded random requests and greedy ones, in another order.
    noise_prompts = random_prompts([7, 16, 4, 12], seed=6)
    noise_params = [SamplingParams(temperature=0.8, max_tokens=9), greedy(5), SamplingParams(max_tokens=15),
                    SamplingParams(temperature=1.3, top_k=5, max_tokens=3)]
    batch_prompts = noise_prompts[:2] + PROMPTS[::-1] + noise_prompts[2:]
    batch_params = noise_params[:2] + params[::-1] + noise_params[2:]
    batched = token_ids(llm, batch_prompts, batch_params)[2 : 2 + len(PROMPTS)][::-1]
    assert batched == alone
    assert len({tuple(t) for t in alone}) == len(alone)


def test_same_seed_same_tokens_after_preemption(model_dir, make_llm, llm):
    params = [seeded(200 + i, max_tokens=14) for i in range(len(PROMPTS))]
    alone = [token_ids(llm, [prompt], p)[0] for prompt, p in zip(PROMPTS, params)]
    small = make_llm(model_dir, num_kv_blocks=9, block_size=4)  # 36 tokens; the longest needs 34
    assert token_ids(small, PROMPTS, params) == alone
    assert small.engine.scheduler.num_preemptions > 0


def test_different_seeds_differ(llm):
    prompt = PROMPTS[1]
    runs = [token_ids(llm, [prompt], seeded(seed, max_tokens=10))[0] for seed in (1, 2, 3)]
    assert len({tuple(run) for run in runs}) == 3
    assert token_ids(llm, [prompt], seeded(2, max_tokens=10))[0] == runs[1]


def test_n_samples_are_distinct_and_reproducible(llm):
    params = seeded(7, max_tokens=10, n=3)
    first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    samples = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) == 3
    assert samples == [c.token_ids for c in again.outputs]


def test_top_k_one_and_tiny_top_p_equal_greedy(llm):
    expected = token_ids(llm, PROMPTS, greedy())
    assert token_ids(llm, PROMPTS, [seeded(i, top_k=1) for i in range(len(PROMPTS))]) == expected
    assert token_ids(llm, PROMPTS, [seeded(i, top_p=1e-6) for i in range(len(PROMPTS))]) == expected
    # And plain temperature sampling does not (the two checks above can fail).
    assert token_ids(llm, PROMPTS, [seeded(i) for i in range(len(PROMPTS))]) != expected


# --------------------------------------------------------------------------------------------------
# The sampler on fixed logits
# --------------------------------------------------------------------------------------------------

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
NUM_DRAWS = 20000


def sample_many(params: SamplingParams, seeds, output_positions) -> torch.Tensor:
    """One row per (seed, output position), all with LOGITS."""
    requests = [Request(request_id=f"r{i}", prompt_token_ids=[0], params=params, seed=seed)
                for i, seed in enumerate(seeds)]
    meta = build_sampling_metadata(requests, LOGITS.numel())
    # As if each request had already produced that many tokens (cheaper than building the outputs).
    meta.draw_seeds = [_draw_seed(seed, position) for seed, position in zip(seeds, output_positions)]
    return torch.tensor(sample(LOGITS.repeat(len(requests), 1), meta).token_ids)


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=LOGITS.numel()).float() / tokens.numel()


def expected_probs(temperature: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    logits = LOGITS / temperature
    if keep is not None:
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits.softmax(-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax_across_seeds(temperature):
    tokens = sample_many(SamplingParams(temperature=temperature), range(NUM_DRAWS), [0] * NUM_DRAWS)
    # 20000 draws: a standard error below 0.0036; 0.012 is over 3 of them.
    torch.testing.assert_close(frequencies(tokens), expected_probs(temperature), atol=0.012, rtol=0)


def test_temperature_sampling_follows_softmax_across_positions():
    """One seed, many output positions: the noise is fresh at each position."""
    tokens = sample_many(SamplingParams(temperature=1.0), [12345] * NUM_DRAWS, range(NUM_DRAWS))
    torch.testing.assert_close(frequencies(tokens), expected_probs(1.0), atol=0.012, rtol=0)


def test_top_k_top_p_min_p_truncate_then_renormalise():
    seeds, positions = range(NUM_DRAWS), [0] * NUM_DRAWS
    top2 = torch.tensor([True, True, False, False, False, False])
    tokens = sample_many(SamplingParams(temperature=1.0, top_k=2), seeds, positions)
    torch.testing.assert_close(frequencies(tokens), expected_probs(1.0, top2), atol=0.012, rtol=0)
    # softmax(LOGITS) = [.55, .20, .12, .07, .03, .00]: top_p=0.7 keeps the first two.
    tokens = sample_many(SamplingParams(temperature=1.0, top_p=0.7), seeds, positions)
    torch.testing.assert_close(frequencies(tokens), expected_probs(1.0, top2), atol=0.012, rtol=0)
    # min_p=0.2 keeps tokens with p >= 0.11: the first three.
    top3 = torch.tensor([True, True, True, False, False, False])
    tokens = sample_many(SamplingParams(temperature=1.0, min_p=0.2), seeds, positions)
    torch.testing.assert_close(frequencies(tokens), expected_probs(1.0, top3), atol=0.012, rtol=0)


def test_greedy_rows_ignore_noise_in_a_mixed_batch():
    requests = [
        Request(request_id=f"r{i}", prompt_token_ids=[0], seed=i,
                params=SamplingParams(temperature=0.0 if i % 2 else 5.0))
        for i in range(200)
    ]
    logits = LOGITS.repeat(len(requests), 1)
    tokens = sample(logits, build_sampling_metadata(requests, LOGITS.numel())).token_ids
    assert all(token == 0 for token in tokens[1::2])
    assert len(set(tokens[0::2])) > 1


def test_penalties_and_bias_arithmetic():
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5, 1.0]])
    request = Request(
        request_id="r", prompt_token_ids=[3], seed=0,
        params=SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25,
                              repetition_penalty=2.0, logit_bias={4: 10.0}),
    )
    request.output_token_ids = [0, 0, 2]
    request.all_token_ids = [3, 0, 0, 2]
    meta = build_sampling_metadata([request], 5)
    from pagoda.engine.sampler import apply_penalties

    penalised = apply_penalties(logits, meta.penalties)
    expected = torch.tensor([[
        3.0 / 2.0 - 0.25 * 2 - 0.5,  # output twice, seen: repetition divides a positive logit
        2.0,  # never seen
        -1.0 * 2.0 - 0.25 - 0.5,  # output once: repetition multiplies a negative logit
        0.5 / 2.0,  # in the prompt only: repetition penalty, no presence/frequency
        1.0 + 10.0,  # logit bias
    ]])
    torch.testing.assert_close(penalised, expected)
    assert sample(logits, meta).token_ids == [4]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])  # eos (1) and the stop token (2) lead
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    request = Request(request_id="r", prompt_token_ids=[0], params=params, seed=0, eos_token_ids=(EOS,))
    request.output_token_ids = [3]
    assert sample(logits, build_sampling_metadata([request], 4)).token_ids == [3]
    request.output_token_ids = [3, 3]
    assert sample(logits, build_sampling_metadata([request], 4)).token_ids == [1]


# --------------------------------------------------------------------------------------------------
# Logprobs against transformers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log_softmax of transformers' logits at each output position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(-1)


def check_logprobs(completion, reference: torch.Tensor, k: int, length: int | None = None) -> None:
    """The first `length` positions' logprobs: the chosen token and the top k, as in `reference`."""
    assert len(completion.logprobs) == len(completion.token_ids)
    cumulative = sum(entry[t] for entry, t in zip(completion.logprobs, completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(cumulative)
    checked = zip(completion.logprobs[:length], completion.token_ids[:length])
    for position, (entry, chosen) in enumerate(checked):
        top_ids = reference[position].topk(k).indices.tolist() if k else []
        assert chosen in entry
        assert set(entry) == {chosen, *top_ids}, f"position {position}"
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(reference[position, token_id].item(), abs=1e-4)


def test_greedy_logprobs_match_transformers(llm, model_dir, hf_reference):
    max_tokens = 12
    for prompt in PROMPTS[:3]:
        completion = generate(llm, [prompt], greedy(max_tokens, logprobs=3))[0]
        reference = hf_reference(model_dir, prompt, max_tokens)
        diverged = compare_with_reference(completion.token_ids, reference, "logprobs")
        length = max_tokens if diverged is None else diverged  # the reference path ends at a divergence
        check_logprobs(completion, reference.logits.log_softmax(-1), 3, length)
        assert all(len(entry) == 3 for entry in completion.logprobs), "greedy: the chosen token is the top one"


@pytest.mark.parametrize("k", [0, 2])
def test_sampled_logprobs_match_transformers(llm, hf_model, k):
    prompt = PROMPTS[2]
    completion = generate(llm, [prompt], seeded(11, max_tokens=10, logprobs=k, temperature=1.5))[0]
    check_logprobs(completion, hf_logprobs(hf_model, prompt, completion.token_ids), k)
    if k == 0:
        assert all(len(entry) == 1 for entry in completion.logprobs)
    else:
        assert any(len(entry) == k + 1 for entry in completion.logprobs), "a sampled token outside the top k"


def test_no_logprobs_unless_asked(llm):
    completion = generate(llm, [PROMPTS[0]], greedy(4))[0]
    assert completion.logprobs is None and completion.cumulative_logprob is None


# --------------------------------------------------------------------------------------------------
# Stopping and penalties, end to end
# --------------------------------------------------------------------------------------------------


def test_max_tokens_gives_length(llm):
    for max_tokens in (1, 5):
        completion = generate(llm, [PROMPTS[1]], greedy(max_tokens))[0]
        assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"


def test_stop_token_ids_stop_at_first_occurrence(llm):
    baseline = token_ids(llm, [PROMPTS[3]], greedy(16))[0]
    position = next(i for i in range(3, 16) if baseline[i] not in baseline[:i])
    stop_token = baseline[position]
    completion = generate(llm, [PROMPTS[3]], greedy(16, stop_token_ids=[stop_token]))[0]
    assert completion.token_ids == baseline[: position + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_token


def test_eos_stops_unless_ignored(llm):
    forced_eos = {EOS: 100.0}
    stopped = generate(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, logit_bias=forced_eos))[0]
    assert stopped.token_ids == [EOS] and stopped.finish_reason == "stop" and stopped.text == ""
    ignored = generate(llm, [PROMPTS[0]], greedy(8, logit_bias=forced_eos))[0]
    assert ignored.token_ids == [EOS] * 8 and ignored.finish_reason == "length"
    delayed = generate(
        llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, logit_bias=forced_eos)
    )[0]
    assert len(delayed.token_ids) == 4 and EOS not in delayed.token_ids[:3] and delayed.token_ids[3] == EOS
    assert delayed.finish_reason == "stop"


def test_logit_bias_steers_greedy_choice(llm, model_dir, hf_reference):
    prompt = PROMPTS[4]
    reference = hf_reference(model_dir, prompt, 4)
    first = reference.token_ids[0]
    runner_up = reference.logits[0].topk(2).indices[1].item()
    banned = generate(llm, [prompt], greedy(1, logit_bias={first: -100.0}))[0]
    assert banned.token_ids == [runner_up]
    forced = generate(llm, [prompt], greedy(6, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 6


@pytest.mark.parametrize(
    "penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=2.0)]
)
def test_penalties_only_change_repeated_choices(llm, penalty):
    """A penalty lowers only the logits of tokens already seen, so greedy output can first change where
    the unpenalised choice was a repeat, and it does change somewhere."""
    baselines = token_ids(llm, PROMPTS, greedy(24))
    penalised = token_ids(llm, PROMPTS, greedy(24, **penalty))
    changed = 0
    for prompt, base, pen in zip(PROMPTS, baselines, penalised):
        if base == pen:
            continue
        changed += 1
        position = next(i for i, (a, b) in enumerate(zip(base, pen)) if a != b)
        seen = set(base[:position]) | (set(prompt) if "repetition_penalty" in penalty else set())
        assert base[position] in seen, f"changed a fresh choice at {position}: {base} -> {pen}"
    assert changed > 0, "the penalty changed nothing"
