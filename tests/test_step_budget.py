"""Stall-bounded scheduling: while requests decode, a step's prefill is held to the step-time target.

The scheduler tests run without a model: a step's "time" is a known linear function of its tokens, shown
to the scheduler as the engine would show it a measured step. The engine test runs a tiny model with a
fixed cost model and counts the prefill tokens of every step while decodes run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import compare_with_reference, random_prompts, register_engine
from test_scheduler import fake_sample, make_request

from pagoda.config import SchedulerConfig
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import FinishReason
from pagoda.engine.core.scheduler import Scheduler, SchedulerOutput
from pagoda.engine.core.step_budget import LinearStepCost, prefill_token_cap
from pagoda.sampling import SamplingParams

FIXED_S, PER_TOKEN_S = 0.05, 0.001  # the simulated machine: a step costs 50 ms + 1 ms a token


def true_seconds(num_tokens: int) -> float:
    return FIXED_S + PER_TOKEN_S * num_tokens


def split(output: SchedulerOutput) -> tuple[int, int]:
    """(decode rows, prefill tokens) of one step."""
    decodes = sum(1 for item in output.scheduled if item.is_decode)
    return decodes, output.num_batched_tokens - decodes


def make_scheduler(max_step_ms: float, budget: int = 512, threshold: int = 0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=1024,
                             max_step_ms=max_step_ms, long_prefill_token_threshold=threshold)
    return Scheduler(config, KVCacheManager(1024, 4, True))


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, fake_sample(output))
    scheduler.observe_step(output, true_seconds(output.num_batched_tokens))
    return output


def start_decoding(scheduler: Scheduler, count: int) -> None:
    """`count` requests with long outputs, run until all of them decode. Their prompts (80 tokens each) are
    prefilled in one step of at least 256 tokens: the cost model learns its slope there."""
    for index in range(count):
        scheduler.add_request(make_request(f"stream{index}", 80, max_tokens=400, first_token=100 + index * 100))
    run_step(scheduler)
    for _ in range(3):
        assert split(run_step(scheduler)) == (count, 0)


def add_long_prompts(scheduler: Scheduler, count: int, length: int = 600) -> None:
    for index in range(count):
        scheduler.add_request(make_request(f"long{index}", length, max_tokens=2, first_token=1000 + index * 700))


# --- the cost model ------------------------------------------------------------------------------------


def test_linear_cost_learns_the_slope_from_large_steps_and_the_fixed_part_from_all():
    cost = LinearStepCost()
    for num_tokens in (4, 32, 100):
        cost.observe(num_tokens, true_seconds(num_tokens))
    assert cost.predict(10) is None and cost.tokens_within(1.0) is None, "no large step yet: no prediction"
    for num_tokens in (600, 4) * 40:
        cost.observe(num_tokens, true_seconds(num_tokens))
    fixed, per_token = cost.coefficients()
    assert fixed == pytest.approx(FIXED_S, rel=0.02) and per_token == pytest.approx(PER_TOKEN_S, rel=0.02)


def test_same_sized_steps_move_only_the_fixed_part_so_the_operating_point_is_predicted_exactly():
    cost = LinearStepCost(per_token=0.002, fixed=0.0)  # a slope twice too steep, from some earlier large step
    for _ in range(40):
        cost.observe(50, true_seconds(50))
    assert cost.per_token == 0.002, "steps under min_slope_tokens never move the slope"
    assert cost.predict(50) == pytest.approx(true_seconds(50))
    assert cost.predict(60) > true_seconds(60), "away from it, a too-steep slope errs on the cautious side"


def test_linear_cost_follows_a_slower_machine():
    cost = LinearStepCost()
    for num_tokens in (600, 4) * 5:
        cost.observe(num_tokens, true_seconds(num_tokens))
    for num_tokens in (600, 4) * 20:
        cost.observe(num_tokens, 2 * true_seconds(num_tokens))
    assert cost.predict(300) == pytest.approx(2 * true_seconds(300), rel=0.05)


def test_prefill_cap_fills_the_target_and_never_starves_prefill():
    cost = LinearStepCost(per_token=PER_TOKEN_S, fixed=FIXED_S)
    assert prefill_token_cap(cost, 0, 0.1) is None, "nothing decodes: no cap"
    assert prefill_token_cap(cost, 8, 0.0) is None, "no target: no cap"
    assert prefill_token_cap(LinearStepCost(), 8, 0.1) is None, "nothing learnt yet: no cap"
    assert prefill_token_cap(cost, 8, 0.15) == 92  # 50 ms + 8 decodes + 92 prefill tokens = 150 ms
    # 8 decodes take 58 ms: under a 100 ms target prefill still gets as long as they take (116 ms in all).
    assert prefill_token_cap(cost, 8, 0.1) == 58
    assert prefill_token_cap(cost, 8, 0.03) == 58, "the decodes alone take longer than the target"


# --- the scheduler against a simulated machine -------------------------------------------------------


def test_steps_with_decodes_stay_within_the_target_while_a_burst_of_prompts_prefills():
    target_s = 0.15
    scheduler = make_scheduler(max_step_ms=target_s * 1e3)
    start_decoding(scheduler, 4)
    add_long_prompts(scheduler, 3)
    prefill_per_step = []
    while any(r.request_id.startswith("long") for r in [*scheduler.running, *scheduler.waiting]):
        output = run_step(scheduler)
        decodes, prefill = split(output)
        assert decodes >= 4, "the streams keep decoding every step"
        assert true_seconds(output.num_batched_tokens) <= target_s + 1e-9
        prefill_per_step.append(prefill)
    assert sum(prefill_per_step) == 3 * 600, "every prompt token was computed"
    # The slope learnt from the first step overestimates (it included the fixed part), so the first chunk
    # is cautious; the fixed part then settles where steps of this size take their measured time, and the
    # chunks come to fill the target (50 ms + 4 decodes + 96 prefill tokens = 150 ms) from below.
    assert prefill_per_step[0] < 90 and 94 <= max(prefill_per_step) <= 96
    assert all(prefill > 0 for prefill in prefill_per_step[:-1]), "prefill progressed every step"


def test_decodes_over_the_target_still_leave_prefill_as_much_time_as_they_take():
    scheduler = make_scheduler(max_step_ms=20)  # less than the 50 ms a step costs anyway
    start_decoding(scheduler, 4)
    add_long_prompts(scheduler, 1)
    for _ in range(8):
        output = run_step(scheduler)
        decodes, prefill = split(output)
        assert decodes == 4, "the long prompt is still prefilling"
        # At most the decodes' own 54 ms more, and not much less: prefill keeps going at about half speed.
        assert true_seconds(output.num_batched_tokens) <= 2 * true_seconds(decodes) + 1e-9
        assert prefill >= 40


def test_without_decodes_prefill_takes_the_whole_budget():
    scheduler = make_scheduler(max_step_ms=100, budget=512)
    start_decoding(scheduler, 1)  # the model has learnt the costs...
    scheduler.finish_requests([scheduler.running[0]], FinishReason.ABORT)  # ...and nothing decodes any more
    add_long_prompts(scheduler, 2)
    assert split(run_step(scheduler)) == (0, 512)


def test_no_target_gives_prefill_the_budget_even_while_decoding():
    scheduler = make_scheduler(max_step_ms=0, budget=512)
    start_decoding(scheduler, 4)
    add_long_prompts(scheduler, 2)
    assert split(run_step(scheduler)) == (4, 508)


def test_long_prefill_token_threshold_caps_each_requests_chunk():
    scheduler = make_scheduler(max_step_ms=0, budget=512, threshold=100)
    add_long_prompts(scheduler, 3, length=250)
    output = run_step(scheduler)
    assert [item.num_tokens for item in output.scheduled] == [100, 100, 100]


# --- the engine, with a tiny model --------------------------------------------------------------------


@dataclass
class TokensPerStep:
    """A cost model of a machine where every token costs the same 1 ms: deterministic, whatever the host."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def predict(self, num_tokens: int) -> float:
        return 0.001 * num_tokens

    def tokens_within(self, seconds: float) -> int:
        return int(seconds / 0.001 + 1e-9)


def test_engine_caps_prefill_tokens_per_step_while_decoding_and_output_matches_transformers(
    checkpoint, hf_reference
):
    from pagoda.engine.engine import LLMEngine
    from pagoda.entrypoints import build_engine_config

    model_dir = checkpoint("llama")
    config = build_engine_config(model_dir, num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                                 max_step_ms=20)  # 20 tokens a step while anything decodes
    engine = LLMEngine(config, step_cost=TokensPerStep())
    register_engine(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    *short, long_prompt = random_prompts([6, 6, 150], seed=3)
    for index, prompt in enumerate(short):
        engine.add_request(f"stream{index}", prompt, greedy)
    outputs: dict[str, list[int]] = {}
    steps = []  # (decoding requests as the step starts, the long prompt's tokens computed in it)
    while engine.has_unfinished_requests():
        decoding = sum(1 for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1)
        long = engine.scheduler.requests.get("long")
        before = None if long is None else long.num_computed_tokens
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        if long is not None and before < long.num_prompt_tokens:
            steps.append((decoding, min(long.num_computed_tokens, long.num_prompt_tokens) - before))
        if long is None and decoding == 2:
            engine.add_request("long", long_prompt, greedy)
    assert sum(prefill for _, prefill in steps) == len(long_prompt)
    for decodes, prefill in steps:
        assert prefill <= (20 - decodes if decodes else 64), steps
    assert steps[0] == (2, 18), "while both streams decode: 2 + 18 tokens = the 20 ms target"
    for request_id, prompt in [("stream0", short[0]), ("stream1", short[1]), ("long", long_prompt)]:
        compare_with_reference(outputs[request_id], hf_reference(model_dir, prompt, 24), request_id)
