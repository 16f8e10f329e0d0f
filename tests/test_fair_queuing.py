"""Fair queuing among tenants, on the scheduler without a model: a flooding tenant does not make another wait
behind its backlog, weights split the tokens a saturated engine hands out, idle time banks no credit, and one
tenant (or none) keeps the policy's own order."""

from __future__ import annotations

from collections import Counter

import pytest
from test_scheduler import assert_consistent, make_request, make_scheduler, step

from pagoda.engine.api import TenantShare
from pagoda.engine.core.request import Request, RequestStatus


def tenant_request(request_id: str, tenant: TenantShare | None, prompt_len: int = 8, max_tokens: int = 8,
                   first_token: int = 10) -> Request:
    request = make_request(request_id, prompt_len, max_tokens=max_tokens, first_token=first_token)
    request.tenant = tenant
    return request


def run_until_done(scheduler, max_steps: int = 10_000) -> list[str]:
    """Steps to the end; the ids of requests in the order they were admitted."""
    admitted: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return admitted
        before = {r.request_id for r in scheduler.running}
        step(scheduler)
        admitted += [r.request_id for r in scheduler.running if r.request_id not in before]
        assert_consistent(scheduler)
    raise AssertionError("did not finish")


def test_a_tenant_arriving_behind_a_flood_is_admitted_next_not_after_it():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    flood, light = TenantShare("flood"), TenantShare("light")
    for i in range(12):
        scheduler.add_request(tenant_request(f"flood-{i}", flood, first_token=100 + 20 * i))
    for _ in range(3):
        step(scheduler)
    scheduler.add_request(tenant_request("light-0", light, first_token=1000))
    assert len(scheduler.waiting) == 11
    # Behind 10 waiting flood requests, the light tenant's is the next admitted: it starts at the flood's counter,
    # and the flood's running requests take it past that before the next admission (FCFS would admit it last).
    assert run_until_done(scheduler)[0] == "light-0"


def test_without_tenants_the_order_is_the_policys():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    for i in range(8):
        scheduler.add_request(tenant_request(f"r{i}", None, first_token=100 + 20 * i))
    assert run_until_done(scheduler) == [f"r{i}" for i in range(8)]


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_weights_split_the_tokens_of_a_saturated_engine(weights):
    """Both tenants keep a deep backlog; over the run, each one's share of the tokens the scheduler handed out
    matches its weight within 10%."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)
    tenants = [TenantShare("a", weights[0]), TenantShare("b", weights[1])]
    tokens: Counter[str] = Counter()
    count = 0
    for step_index in range(400):
        for tenant in tenants:  # top each backlog up to 6 waiting requests
            while sum(1 for r in scheduler.waiting if r.tenant == tenant) < 6:
                count += 1
                scheduler.add_request(tenant_request(f"{tenant.name}-{count}", tenant, prompt_len=12, max_tokens=6,
                                                     first_token=10 + 20 * count))
        output = step(scheduler)
        if step_index >= 50:  # past the start, when only a's first requests ran
            for item in output.scheduled:
                tokens[item.request.tenant.name] += item.num_tokens
    share = tokens["a"] / (tokens["a"] + tokens["b"])
    assert share == pytest.approx(weights[0] / sum(weights), rel=0.1)


def test_a_tenant_back_from_idle_banks_no_credit():
    """b was away while a was served: on its return it starts at a's counter, so the two alternate instead of b
    taking every slot until it has caught up."""
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    a, b = TenantShare("a"), TenantShare("b")
    for i in range(6):
        scheduler.add_request(tenant_request(f"a-{i}", a, first_token=100 + 20 * i))
    for _ in range(30):
        step(scheduler)
    for i in range(4):
        scheduler.add_request(tenant_request(f"b-{i}", b, first_token=1000 + 20 * i))
    a_left = sum(1 for r in scheduler.waiting if r.tenant == a)
    assert a_left >= 2
    order = "".join(name[0] for name in run_until_done(scheduler))
    # They alternate while both wait (had b kept its counter of 0, it would take four slots in a row).
    assert order[: 2 * a_left] in ("ab" * a_left, "ba" * a_left), order


def test_preemption_between_tenants_finishes_every_request_with_the_pool_consistent():
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = TenantShare("a"), TenantShare("b")
    first = tenant_request("a-0", a, prompt_len=8, max_tokens=12)
    scheduler.add_request(first)
    scheduler.add_request(tenant_request("b-0", b, prompt_len=8, max_tokens=12, first_token=200))
    statuses = set()
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        output = step(scheduler)
        statuses |= {r.request_id for r in output.preempted}
        assert_consistent(scheduler)
    assert statuses, "the pool was meant to be too small for both"
    assert not scheduler.has_unfinished_requests()
    assert first.status == RequestStatus.FINISHED and len(first.output_token_ids) == 12


@pytest.mark.parametrize("quota, first_victim", [(None, "b-0"), (2, "a-0"), (100, "b-0")])
def test_a_tenant_over_its_kv_quota_is_preempted_first(quota, first_victim):
    """a's request is the older, so the policy alone preempts b's; with a holding more blocks than its quota,
    a's goes first."""
    scheduler = make_scheduler(num_blocks=7, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(tenant_request("a-0", TenantShare("a", max_kv_blocks=quota), max_tokens=12))
    scheduler.add_request(tenant_request("b-0", TenantShare("b"), max_tokens=12, first_token=200))
    preempted: list[str] = []
    while scheduler.has_unfinished_requests():
        preempted += [r.request_id for r in step(scheduler).preempted]
        assert_consistent(scheduler)
    assert preempted and preempted[0] == first_victim


def test_a_tenant_takes_its_place_back_from_a_burst_that_filled_the_batch():
    """The flood's burst took every place while light was away; when light comes, the next step preempts the
    flood's newest running request and admits light's, which finishes long before the flood's (it would have
    waited for a flood request to end); the preempted request finishes too, its output whole."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    flood, light = TenantShare("flood"), TenantShare("light")
    burst = [tenant_request(f"flood-{i}", flood, max_tokens=40, first_token=100 + 50 * i) for i in range(6)]
    for request in burst:
        scheduler.add_request(request)
    for _ in range(3):
        step(scheduler)
    assert [r.request_id for r in scheduler.running] == [f"flood-{i}" for i in range(4)]
    mine = tenant_request("light-0", light, max_tokens=4, first_token=1000)
    scheduler.add_request(mine)
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["flood-3"]
    assert mine in scheduler.running and len(scheduler.running) == 4
    finished_at: dict[str, int] = {}
    for step_index in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler)
        assert_consistent(scheduler)
        for request in [mine, *burst]:
            if request.status == RequestStatus.FINISHED:
                finished_at.setdefault(request.request_id, step_index)
    assert finished_at["light-0"] < min(finished_at[r.request_id] for r in burst)
    assert all(len(r.output_token_ids) == 40 for r in burst)


def test_no_place_is_taken_from_a_tenant_within_its_share():
    """a and b hold two places each of four (equal weights: their shares); a's third request waits for a place
    instead of taking one of b's, and b's second wait likewise."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = TenantShare("a"), TenantShare("b")
    for i in range(2):
        scheduler.add_request(tenant_request(f"a-{i}", a, max_tokens=30, first_token=100 + 50 * i))
        scheduler.add_request(tenant_request(f"b-{i}", b, max_tokens=30, first_token=400 + 50 * i))
    step(scheduler)
    scheduler.add_request(tenant_request("a-2", a, max_tokens=30, first_token=900))
    scheduler.add_request(tenant_request("b-2", b, max_tokens=30, first_token=950))
    for _ in range(10):
        assert not step(scheduler).preempted
    assert len(scheduler.waiting) == 2


def test_a_tenant_below_its_places_is_not_held_up_behind_one_at_its_own():
    """b has been served more tokens than the flood (a higher counter), so the flood's waiting request is the
    queue's head; the batch is full and the flood holds most of it, so that head cannot take a place. b's
    request (b holds none of its two places) still takes one from the flood, rather than waiting behind the
    flood's head for a place to free."""
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=64)
    b, flood = TenantShare("b"), TenantShare("flood")
    for i in range(5):
        scheduler.add_request(tenant_request(f"flood-{i}", flood, max_tokens=200, first_token=100 + 50 * i))
    for _ in range(3):
        step(scheduler)
    assert len(scheduler.running) == 4 and [r.request_id for r in scheduler.waiting] == ["flood-4"]
    scheduler.waiting.counters["b"] = scheduler.waiting.counters["flood"] + 1000.0  # b was served more
    scheduler.add_request(tenant_request("b-0", b, max_tokens=200, first_token=900))
    assert scheduler.waiting.peek().request_id == "flood-4", "the flood's request heads the queue"
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["flood-3"]
    assert Counter(r.tenant.name for r in scheduler.running) == {"b": 1, "flood": 3}
