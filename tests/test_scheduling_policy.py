"""Scheduling policies: fcfs and priority (lower first, FCFS within a level, aging bounds the wait of the
lower levels, preemption of lower-ranked running requests). The policy only reorders work: greedy output
is what transformers gives."""

from __future__ import annotations

import zlib

import pytest
from conftest import compare_with_reference, random_prompts
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server
from test_scheduler import assert_consistent, fake_sample, make_request

from pagoda.config import SchedulerConfig
from pagoda.engine.api import RequestRejected
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import FinishReason, Request
from pagoda.engine.core.scheduler import Scheduler
from pagoda.sampling import SamplingParams


def make_scheduler(policy: str = "priority", aging_s: float = 0.0, num_blocks: int = 64,
                   max_num_seqs: int = 1) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=1024,
                             scheduling_policy=policy, priority_aging_s=aging_s)
    return Scheduler(config, KVCacheManager(num_blocks, 4, True))


def request(name: str, priority: int, arrival: float, prompt_len: int = 4, max_tokens: int = 2) -> Request:
    # Distinct tokens per name (crc32: stable across runs, unlike hash()), so no prefix is shared by chance.
    first_token = 10 + 50 * (zlib.crc32(name.encode()) % 100)
    made = make_request(name, prompt_len, max_tokens=max_tokens, first_token=first_token)
    made.priority, made.arrival_time = priority, arrival
    return made


def admission_order(scheduler: Scheduler, max_steps: int = 1000) -> list[str]:
    """Runs the queue dry; the order in which requests were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return order
        output = scheduler.schedule()
        order += [item.request.request_id for item in output.scheduled if item.request.request_id not in order]
        scheduler.update(output, fake_sample(output))
        assert_consistent(scheduler)
    raise AssertionError("the queue did not drain")


def test_priority_runs_lower_values_first_and_fcfs_within_a_level():
    scheduler = make_scheduler()
    for name, priority, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", -1, 4.0)]:
        scheduler.add_request(request(name, priority, arrival))
    assert admission_order(scheduler) == ["e", "b", "d", "c", "a"]


def test_fcfs_keeps_arrival_order():
    scheduler = make_scheduler(policy="fcfs")
    for name, arrival in [("a", 0.0), ("b", 1.0), ("c", 2.0)]:
        scheduler.add_request(request(name, 0, arrival))
    assert admission_order(scheduler) == ["a", "b", "c"]


def overloaded_run(aging_s: float, steps: int = 120) -> tuple[list[str], dict[str, float]]:
    """One low-priority request, then a high-priority request every step, each needing 3 steps of the one
    slot: the queue of high-priority work grows without end. Returns the admission order and arrivals."""
    scheduler = make_scheduler(aging_s=aging_s)
    arrivals = {"low": 0.0}
    scheduler.add_request(request("low", 1, 0.0, max_tokens=3))
    order: list[str] = []
    for step_index in range(steps):
        name = f"high{step_index}"
        arrivals[name] = 0.5 + step_index  # one a second, the first half a second after the low one
        scheduler.add_request(request(name, 0, arrivals[name], max_tokens=3))
        output = scheduler.schedule()
        order += [item.request.request_id for item in output.scheduled if item.request.request_id not in order]
        scheduler.update(output, fake_sample(output))
    for item in [*scheduler.running, *scheduler.waiting]:  # stop the endless stream
        scheduler.finish_requests([item], FinishReason.ABORT)
    return order, arrivals


def test_strict_priority_starves_the_lower_level_under_endless_higher_load():
    order, _ = overloaded_run(aging_s=0.0)
    assert "low" not in order, "vLLM's strict order: the low request never runs while high ones keep coming"


@pytest.mark.parametrize("aging_s", [5.0, 20.0])
def test_aging_bounds_the_wait_only_requests_arriving_within_the_bound_pass_a_lower_level(aging_s):
    order, arrivals = overloaded_run(aging_s=aging_s)
    assert "low" in order
    passed_by = set(order[: order.index("low")])
    # Priority 1 counts as aging_s seconds of later arrival: exactly the priority-0 requests that arrived
    # less than aging_s after it overtake it, and none after.
    assert passed_by == {name for name, arrival in arrivals.items() if name != "low" and arrival < aging_s}


def test_a_priority_request_preempts_lower_ranked_running_requests_when_blocks_run_out():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=4)  # 32 tokens
    low = request("low", 5, 0.0, prompt_len=20, max_tokens=8)
    scheduler.add_request(low)
    scheduler.update(output := scheduler.schedule(), fake_sample(output))
    urgent = request("urgent", 0, 1.0, prompt_len=16, max_tokens=4)
    scheduler.add_request(urgent)
    output = scheduler.schedule()
    assert [r.request_id for r in output.preempted] == ["low"]
    assert [item.request.request_id for item in output.scheduled] == ["urgent"], "low's decode was withdrawn"
    scheduler.update(output, fake_sample(output))
    assert_consistent(scheduler)
    assert admission_order(scheduler)[0] == "urgent"
    assert low.num_preemptions == 1 and low.num_output_tokens == 8, "low finished after all, recomputed"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_request_never_preempts_an_equal_or_higher_ranked_one(policy):
    scheduler = make_scheduler(policy=policy, num_blocks=8, max_num_seqs=4)
    first = request("first", 0, 0.0, prompt_len=20, max_tokens=8)
    scheduler.add_request(first)
    scheduler.update(output := scheduler.schedule(), fake_sample(output))
    scheduler.add_request(request("later", 1 if policy == "priority" else 0, 1.0, prompt_len=16))
    output = scheduler.schedule()
    assert not output.preempted and [item.request.request_id for item in output.scheduled] == ["first"]


# --- the engine: priority is vLLM's, and only reorders work -------------------------------------------


def test_fcfs_refuses_a_priority_it_would_ignore(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama"))
    with pytest.raises(RequestRejected, match="priority scheduling is not enabled") as error:
        llm.generate([[10, 11, 12]], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    assert error.value.param == "priority"
    assert llm.generate([[10, 11, 12]], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)


def test_greedy_output_is_transformers_whatever_the_priorities_and_preemptions(checkpoint, make_llm, hf_reference):
    model_dir = checkpoint("llama")
    # 24 blocks of 4 tokens: not enough for all at once, so higher priorities preempt lower ones.
    llm = make_llm(model_dir, num_kv_blocks=24, block_size=4, scheduling_policy="priority",
                   priority_aging_s=0.0, max_num_seqs=4)
    prompts = random_prompts([20, 9, 30, 14, 25], seed=11)
    priorities = [3, 0, 2, 1, 0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, priority=priorities, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all at once"
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        compare_with_reference(output.outputs[0].token_ids, hf_reference(model_dir, prompt, 16), f"prompt {index}")


# --- the server: fcfs answers a priority with 400 ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy-server")
    server = start_server(make_server_checkpoint(root / "model"), root, "--num-kv-blocks", "64", "--block-size", "4",
                          "--max-num-batched-tokens", "256", served_model_name="tiny")
    yield server
    server.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fcfs_server_answers_a_priority_with_400_naming_the_field(server, path):
    body = {"model": "tiny", "max_tokens": 2, "priority": 3}
    body |= {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(server.post(path, body), 400, param="priority", contains=["priority scheduling"])
    body["priority"] = 0
    assert server.post(path, body).status_code == 200


def test_a_priority_that_is_not_an_integer_is_a_400(server):
    response = server.post("/v1/completions", {"model": "tiny", "prompt": "hello", "priority": "high"})
    assert_openai_error(response, 400)
