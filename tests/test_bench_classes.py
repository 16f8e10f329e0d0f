"""`pagoda bench` per request class: priorities drawn from a mix (seeded, prompts unchanged), latencies and
goodput (requests and tokens) per priority and per prompt-length bucket, the SLO's percentiles with failures
counted as misses, and a sweep's capacity at a percentile. Pure functions on records, then one real run
against `pagoda serve --scheduling-policy priority`."""

from __future__ import annotations

import json
import math

import pytest
from server_fixtures import make_server_checkpoint, start_server

from pagoda.bench import cli
from pagoda.bench.classes import by_class, prompt_bucket
from pagoda.bench.client import Endpoint, RequestOptions, request_body
from pagoda.bench.metrics import distribution, slo_percentiles, summarize
from pagoda.bench.records import RequestRecord
from pagoda.bench.sweep import slo_capacity
from pagoda.bench.tokens import ClientTokenizer
from pagoda.bench.workloads import WorkloadSpec, build_workload, parse_priority_mix

pytestmark = pytest.mark.timeout(120)


def record(index: int, *, priority: int | None = None, prompt: int = 100, ttft: float = 0.1, end: float = 1.0,
           tokens: int = 10, error: str | None = None) -> RequestRecord:
    times = [] if error else [ttft, end]
    return RequestRecord(f"r{index}", index, 0, sent=0.0, chunk_times=times, end=None if error else end,
                         max_tokens=tokens, priority=priority, prompt_tokens=None if error else prompt,
                         expected_prompt_tokens=prompt, output_tokens=None if error else tokens, error=error)


def test_prompt_buckets_are_powers_of_two():
    assert prompt_bucket(1) == (64, "1-64") and prompt_bucket(64) == (64, "1-64")
    assert prompt_bucket(65) == (128, "65-128") and prompt_bucket(129) == (256, "129-256")
    assert prompt_bucket(None)[1] == "unknown"


def test_each_class_has_its_own_percentiles_and_the_goodput_adds_up():
    records = [record(i, priority=i % 2, prompt=50 if i < 6 else 300, ttft=0.01 * (i + 1) + 0.2 * (i % 2),
                      tokens=8 + i) for i in range(10)]
    records.append(record(10, priority=1, prompt=50, error="http_500"))
    slo = {"ttft": 0.15}
    summary = summarize(records, duration=10.0, slo=slo)
    classes = by_class(records, 10.0, slo)
    assert list(classes["priority"]) == ["0", "1"] and list(classes["prompt_len"]) == ["1-64", "257-512"]
    high = classes["priority"]["0"]
    assert high["num_requests"] == 5 and high["num_ok"] == 5
    assert high["ttft"]["p90"] == distribution(r.ttft for r in records if r.priority == 0 and r.ok)["p90"]
    assert classes["priority"]["1"]["num_requests"] == 6 and classes["priority"]["1"]["num_ok"] == 5
    for dimension in classes.values():  # the classes partition the run
        assert sum(c["goodput"]["good_requests"] for c in dimension.values()) == summary["goodput"]["good_requests"]
        assert sum(c["goodput"]["output_tokens_per_s"] for c in dimension.values()) == pytest.approx(
            summary["goodput"]["output_tokens_per_s"])
    good = [r for r in records if r.ok and r.ttft <= 0.15]
    assert summary["goodput"]["output_tokens_per_s"] == pytest.approx(sum(r.output_tokens for r in good) / 10.0)


def test_slo_percentiles_count_a_failure_as_a_miss():
    records = [record(i, ttft=0.1) for i in range(9)] + [record(9, error="timeout")]
    at = slo_percentiles(records, {"ttft": 0.2, "tpot": 1.0})
    assert at["p50"]["ttft"] == pytest.approx(0.1) and math.isinf(at["p99"]["ttft"])
    one_token = [record(0, tokens=1)]
    assert slo_percentiles(one_token, {"tpot": 0.01})["p99"]["tpot"] == 0.0  # no TPOT: passes, as meets_slo


def test_capacity_at_a_percentile_differs_from_the_fraction_rule():
    def point(level: int, ttfts: list[float]) -> dict:
        records = [record(i, ttft=t, end=t + 1) for i, t in enumerate(ttfts)]
        return {"level": level, "load": {"mode": "closed"}, "summary": summarize(records, 10.0, {"ttft": 0.5})}

    # level 2: 95 of 100 within 0.5 s: passes "90% within", fails "p99 within"
    points = [point(1, [0.1] * 100), point(2, [0.1] * 95 + [2.0] * 5), point(4, [2.0] * 100)]
    assert slo_capacity(points, 0.9)["level"] == 2
    assert slo_capacity(points, 0.9, percentile=99)["level"] == 1
    assert slo_capacity(points, 0.9, percentile=90)["level"] == 2


def test_a_priority_mix_is_seeded_and_leaves_the_prompts_alone(tmp_path):
    tokenizer = ClientTokenizer(make_server_checkpoint(tmp_path / "model"))
    plain = build_workload(WorkloadSpec(num_turns=2, kind="multi-turn"), 40, tokenizer, "chat", seed=3)
    spec = WorkloadSpec(num_turns=2, kind="multi-turn", priority_mix=parse_priority_mix("0=3,1=1"))
    mixed = build_workload(spec, 40, tokenizer, "chat", seed=3)
    assert [t.prompt for c in mixed for t in c.turns] == [t.prompt for c in plain for t in c.turns]
    assert all(len({t.priority for t in c.turns}) == 1 for c in mixed)  # a conversation keeps its priority
    drawn = [c.turns[0].priority for c in mixed]
    assert set(drawn) == {0, 1} and drawn.count(0) > drawn.count(1)
    assert drawn == [c.turns[0].priority for c in build_workload(spec, 40, tokenizer, "chat", seed=3)]
    body = request_body(Endpoint.parse("http://x/v1", api="chat", model="m"), mixed[0], 0, [], RequestOptions())
    assert body["priority"] == drawn[0]
    with pytest.raises(ValueError):
        parse_priority_mix("high=1")
    with pytest.raises(ValueError):
        WorkloadSpec(priority_mix=((0, 0.0),))


def test_bench_reports_latency_per_priority_against_a_priority_server(tmp_path):
    model_dir = make_server_checkpoint(tmp_path / "model")
    server = start_server(model_dir, tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", "2",
                          "--no-use-kernels", served_model_name="tiny")
    try:
        out = tmp_path / "bench.json"
        code = cli.main(["--base-url", f"{server.url}/v1", "--tokenizer", str(model_dir), "--input-len", "24",
                         "--output-len", "6", "--ignore-eos", "--warmup", "0", "--no-progress", "--concurrency", "4",
                         "--num-requests", "16", "--priority-mix", "0=1,5=1", "--slo", "ttft=10s",
                         "--out", str(out), "--no-plot"])
        assert code == 0
    finally:
        server.stop()
    [point] = json.loads(out.read_text())["endpoints"][0]["levels"]
    summary = point["summary"]
    assert summary["num_ok"] == 16, summary["errors"]
    priorities = summary["by_class"]["priority"]
    assert set(priorities) == {"0", "5"}
    assert sum(c["num_ok"] for c in priorities.values()) == 16
    assert {r["priority"] for r in point["requests"]} == {0, 5}
    assert summary["goodput"]["output_tokens_per_s"] > 0
