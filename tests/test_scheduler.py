"""The one-budget scheduler without a model: steps are simulated by feeding fake sampled tokens to update()."""

from __future__ import annotations

import itertools

from hypothesis import given, target
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import FinishReason, Request, RequestStatus
from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.scheduler import Scheduler, SchedulerOutput
from pagoda.sampling import SamplingParams

BLOCK_SIZE = 4
FAKE_TOKEN = 7


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 16, max_num_batched_tokens: int = 64, prefix_caching: bool = True
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1024
    )
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching))


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, first_token: int = 10, **params) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, **params),
        seed=0,
        max_model_len=1024,
    )


def fake_sample(output: SchedulerOutput, token: int = FAKE_TOKEN) -> ModelRunnerOutput:
    """A token for every request whose step reaches its last known token, as the runner would sample."""
    return ModelRunnerOutput({item.request.request_id: [token] for item in output.scheduled if item.samples})


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, fake_sample(output))
    return output


def scheduled(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.request.request_id, item.num_tokens) for item in output.scheduled]


def assert_consistent(scheduler: Scheduler) -> None:
    """Pool accounting, checked independently of the manager's own counters."""
    kv = scheduler.kv_cache
    kv.check_invariants()
    held = {block for request in scheduler.running for block in request.block_ids}
    assert len(held) + kv.num_free_blocks == kv.num_blocks
    for request in scheduler.waiting:
        assert request.block_ids == [] and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
        assert len(request.block_ids) * BLOCK_SIZE >= request.num_computed_tokens
    assert not {r.request_id for r in scheduler.waiting} & {r.request_id for r in scheduler.running}


def test_fcfs_admission_and_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    output = scheduler.schedule()
    assert scheduled(output) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.update(output, fake_sample(output))
    assert scheduled(scheduler.schedule()) == [("a", 1), ("b", 1)], "c waits: max_num_seqs is 2"


def test_static_batching_waits_for_the_whole_batch_and_continuous_does_not():
    def steps_run(batching: str, budget: int = 64) -> list[list[str]]:
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=1024, batching=batching)
        scheduler = Scheduler(config, KVCacheManager(64, BLOCK_SIZE, True))
        for name, max_tokens in zip("abcd", (1, 3, 2, 2)):
            scheduler.add_request(make_request(name, 6, max_tokens=max_tokens, first_token=10 * ord(name)))
        names = []
        while scheduler.has_unfinished_requests():
            names.append([item.request.request_id for item in step(scheduler).scheduled])
        assert_consistent(scheduler)
        assert scheduler.kv_cache.num_free_blocks == 64
        return names

    # a's slot is free after one step: continuous gives it to c at once, static keeps it until b ends.
    assert steps_run("continuous") == [["a", "b"], ["b", "c"], ["b", "c"], ["d"], ["d"]]
    assert steps_run("static") == [["a", "b"], ["b"], ["b"], ["c", "d"], ["c", "d"]]
    # A batch whose prompts take several steps still forms: b joins while a's prompt is unfinished.
    assert steps_run("static", budget=4)[:3] == [["a"], ["a", "b"], ["b"]]


def test_head_of_queue_is_not_overtaken_when_it_does_not_fit():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("big", 12, max_tokens=1))  # 3 blocks
    scheduler.add_request(make_request("huge", 16, max_tokens=1, first_token=100))  # 4 blocks: not now
    scheduler.add_request(make_request("small", 2, max_tokens=1, first_token=200))  # fits, but waits its turn
    output = scheduler.schedule()
    assert scheduled(output) == [("big", 12)]
    scheduler.update(output, fake_sample(output))  # big finishes (max_tokens=1)
    assert scheduled(scheduler.schedule()) == [("huge", 16)]


def test_token_budget_is_respected_and_decodes_come_first():
    scheduler = make_scheduler(max_num_batched_tokens=5)
    scheduler.add_request(make_request("a", 3))
    step(scheduler)  # a's prompt, a samples its first token
    scheduler.add_request(make_request("b", 10, first_token=50))
    output = scheduler.schedule()
    assert scheduled(output) == [("a", 1), ("b", 4)], "a's decode first, then as much of b as the budget allows"
    assert output.num_batched_tokens == 5


def test_chunked_prefill_splits_a_long_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 10, max_tokens=2)
    scheduler.add_request(request)
    chunks, samples = [], []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks += [item.num_tokens for item in output.scheduled]
        samples += [item.samples for item in output.scheduled]
        scheduler.update(output, fake_sample(output))
    assert chunks == [4, 4, 2, 1]
    assert samples == [False, False, True, True], "only the chunk reaching the prompt's end samples"
    assert request.output_token_ids == [FAKE_TOKEN, FAKE_TOKEN]
    assert request.finish_reason == FinishReason.LENGTH


def test_preemption_picks_newest_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=4)
    a, b, c = make_request("a", 7), make_request("b", 3, first_token=50), make_request("c", 3, first_token=70)
    d = make_request("d", 2, first_token=90)
    for request in (a, b, c):
        scheduler.add_request(request)
    assert scheduled(step(scheduler)) == [("a", 7), ("b", 3), ("c", 3)]  # 2 + 1 + 1 blocks: pool full
    assert scheduled(step(scheduler)) == [("a", 1), ("b", 1), ("c", 1)]  # all still inside their blocks
    scheduler.add_request(d)
    output = scheduler.schedule()
    # a's next token needs a 3rd block: c (the newest) goes, not b. Then b needs a 2nd block: the
    # newest running request is now b itself.
    assert output.preempted == [c, b]
    assert scheduled(output) == [("a", 1)], "no admission in a step that preempted"
    for request in (b, c):
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert request.block_ids == [] and request.num_preemptions == 1
        assert request.output_token_ids == [FAKE_TOKEN, FAKE_TOKEN], "the output survives; it is recomputed"
    assert scheduler.num_preemptions == 2
    assert [r.request_id for r in scheduler.waiting] == ["b", "c", "d"], "preempted go first, in arrival order"
    assert_consistent(scheduler)


def test_preempted_request_recomputes_prompt_and_output():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", 7, first_token=50, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    step(scheduler)  # each holds 2 full blocks (8 computed tokens); the pool is full
    output = step(scheduler)  # a needs a 3rd block: b is preempted (its last block goes to a)
    assert output.preempted == [b] and a.is_finished
    output = scheduler.schedule()
    # b recomputes 7 prompt + 2 output tokens; its first block is still cached, its second was reused.
    assert scheduled(output) == [("b", 5)] and b.num_computed_tokens == 4
    assert b.num_cached_tokens == 0, "num_cached_tokens counts the first admission only"
    scheduler.update(output, fake_sample(output))
    assert b.num_tokens == 10 and b.output_token_ids == [FAKE_TOKEN] * 3


def test_running_request_is_its_own_victim_when_alone():
    """A running request that cannot grow preempts itself rather than livelocking."""
    scheduler = make_scheduler(num_blocks=2)
    request = make_request("a", 8, max_tokens=4)
    scheduler.add_request(request)
    step(scheduler)
    output = scheduler.schedule()  # token 9 needs a 3rd block; the pool has 2
    assert output.preempted == [request] and output.scheduled == []
    scheduler.finish_requests([request], FinishReason.ABORT)
    assert_consistent(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 2


def test_prefix_cache_hit_on_second_request():
    scheduler = make_scheduler()
    first = make_request("a", 10, max_tokens=1)
    scheduler.add_request(first)
    step(scheduler)
    second = make_request("b", 10, max_tokens=1)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.num_cached_tokens == 8
    assert scheduled(output) == [("b", 2)], "only the uncached tail is computed"
    assert scheduler.prefix_cache_hits == 8 and scheduler.prefix_cache_queries == 20


def test_update_stops_on_stop_token_and_eos():
    scheduler = make_scheduler()
    by_stop = make_request("a", 3, stop_token_ids=[FAKE_TOKEN])
    by_eos = make_request("b", 3, first_token=50)
    by_eos.eos_token_ids = (FAKE_TOKEN,)
    ignoring = make_request("c", 3, first_token=90, max_tokens=2, ignore_eos=True)
    ignoring.eos_token_ids = (FAKE_TOKEN,)
    for request in (by_stop, by_eos, ignoring):
        scheduler.add_request(request)
    step(scheduler)
    assert by_stop.finish_reason == FinishReason.STOP and by_stop.stop_reason == FAKE_TOKEN
    assert by_eos.finish_reason == FinishReason.STOP
    assert not ignoring.is_finished
    step(scheduler)
    assert ignoring.finish_reason == FinishReason.LENGTH and ignoring.num_output_tokens == 2
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_finish_frees_running_and_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("a", 6), make_request("b", 6)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler)
    assert running.block_ids and not waiting.block_ids
    scheduler.finish_requests([running], FinishReason.ABORT)
    scheduler.finish_requests([waiting], FinishReason.ABORT)
    scheduler.finish_requests([waiting], FinishReason.ABORT)  # twice is harmless
    assert not scheduler.has_unfinished_requests()
    assert running.finish_reason == waiting.finish_reason == FinishReason.ABORT
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert_consistent(scheduler)


# --------------------------------------------------------------------------------------------------
# Properties over random workloads
# --------------------------------------------------------------------------------------------------

# A small token alphabet and shared prompt stems make prefix-cache hits (and hash reuse) common.
STEMS = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], []]

add_op = st.tuples(
    st.just("add"),
    st.sampled_from(range(len(STEMS))),
    st.lists(st.integers(30, 40), min_size=1, max_size=14),
    st.integers(1, 16),
)
step_op = st.tuples(st.just("step"), st.integers(30, 40))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))


@given(
    ops=st.lists(st.one_of(add_op, step_op, step_op, abort_op), max_size=60),
    num_blocks=st.integers(4, 16),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
)
def test_random_workloads_keep_the_pool_consistent(ops, num_blocks, max_num_seqs, budget, prefix_caching):
    # As the engine guarantees, max_model_len fits in the pool, so preemption cannot livelock.
    max_len = num_blocks * BLOCK_SIZE
    scheduler = make_scheduler(num_blocks, max_num_seqs, budget, prefix_caching)
    requests: list[Request] = []
    counter = itertools.count()

    def check_step(output: SchedulerOutput) -> None:
        assert output.num_batched_tokens <= budget
        assert len(scheduler.running) <= max_num_seqs
        for item in output.scheduled:
            request = item.request
            assert item.num_tokens >= 1 and request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens + item.num_tokens <= request.num_tokens
            assert len(request.block_ids) * BLOCK_SIZE >= request.num_computed_tokens + item.num_tokens

    def do_step(token: int) -> None:
        output = scheduler.schedule()
        check_step(output)
        scheduler.update(output, fake_sample(output, token))

    for op in ops:
        if op[0] == "add":
            _, stem, tail, max_tokens = op
            max_tokens = min(max_tokens, max_len // 2)
            prompt = (STEMS[stem] + tail)[: max_len - max_tokens]
            request = Request(
                request_id=f"r{next(counter)}",
                prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=max_tokens),
                seed=0,
                max_model_len=max_len,
            )
            requests.append(request)
            scheduler.add_request(request)
        elif op[0] == "step":
            do_step(op[1])
        elif requests:
            scheduler.finish_requests([requests[op[1] % len(requests)]], FinishReason.ABORT)
        assert_consistent(scheduler)

    # Everything left runs to completion, in bounded time, and gives every block back.
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        do_step(35)
        assert_consistent(scheduler)
    assert not scheduler.has_unfinished_requests(), "the workload did not drain (livelock?)"
    assert all(request.is_finished for request in requests)
    for request in requests:
        if request.finish_reason != FinishReason.ABORT:
            assert request.finish_reason == FinishReason.LENGTH
            assert request.num_output_tokens == request.params.max_tokens
    assert scheduler.kv_cache.num_free_blocks == num_blocks
    scheduler.kv_cache.check_invariants()
    # Steer the search towards workloads that preempt and hit the prefix cache.
    target(float(scheduler.num_preemptions), label="preemptions")
    target(float(scheduler.prefix_cache_hits), label="prefix cache hits")
