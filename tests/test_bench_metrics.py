"""`pagoda bench` without a network: metric definitions, percentiles, SLOs, the client's honesty verdict,
arrival schedules, the saturation rule, workloads, request bodies and the SSE parser."""

from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from pagoda.bench.client import Endpoint, RequestOptions, chunk_content, parse_event, request_body
from pagoda.bench.load import LoadSpec, arrival_offsets
from pagoda.bench.metrics import (
    client_verdict,
    distribution,
    inter_chunk_gaps,
    measured_duration,
    meets_slo,
    parse_slo,
    percentile,
    summarize,
    tpot,
)
from pagoda.bench.records import RequestRecord
from pagoda.bench.sweep import doubling_levels, parse_levels, saturation_reason, slo_capacity
from pagoda.bench.tokens import ClientTokenizer
from pagoda.bench.workloads import Conversation, Turn, WorkloadSpec, build_workload, sample_lengths

pytestmark = pytest.mark.timeout(60)


def record(request_id="r", sent=0.0, chunks=(0.2, 0.25, 0.3), end=0.3, prompt=10, output=3, max_tokens=3,
           error=None) -> RequestRecord:
    return RequestRecord(request_id, sent=sent, chunk_times=list(chunks), end=end, prompt_tokens=prompt,
                         output_tokens=output, max_tokens=max_tokens, error=error)


# --- definitions -------------------------------------------------------------------------------------------


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert tpot(e2e=0.6, ttft=0.2, num_output_tokens=9) == pytest.approx(0.05)
    assert tpot(e2e=0.6, ttft=0.2, num_output_tokens=1) is None  # one token: no time "per output token"
    assert tpot(e2e=None, ttft=0.2, num_output_tokens=9) is None


def test_itl_is_every_gap_between_content_chunks():
    assert inter_chunk_gaps([0.2, 0.25, 0.35, 0.36]) == pytest.approx([0.05, 0.1, 0.01])
    assert inter_chunk_gaps([0.2]) == []


def test_percentiles_match_numpy_linear_interpolation():
    values = sorted(random.Random(0).uniform(0, 10) for _ in range(37))
    for q in (0, 1, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    stats = distribution([3.0, None, 1.0, 2.0, 4.0])
    assert stats["count"] == 4 and stats["mean"] == 2.5 and stats["p50"] == 2.5
    assert stats["min"] == 1.0 and stats["max"] == 4.0 and stats["p99"] == pytest.approx(3.97)
    assert distribution([])["p50"] is None


def test_summary_of_known_records():
    # two requests of 1 s each, back to back; 100 prompt + 11 output tokens each; a third one failed
    first = record("a", sent=0.0, chunks=[0.5 + 0.05 * i for i in range(11)], end=1.0, prompt=100, output=11)
    second = record("b", sent=1.0, chunks=[0.3 + 0.07 * i for i in range(11)], end=1.0, prompt=100, output=11)
    failed = record("c", sent=0.5, chunks=[], end=0.1, prompt=None, output=None, error="http_429")
    summary = summarize([first, second, failed])
    assert summary["duration_s"] == pytest.approx(2.0)
    assert summary["num_ok"] == 2 and summary["errors"] == {"http_429": 1}
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["input_throughput"] == pytest.approx(100.0)
    assert summary["output_throughput"] == pytest.approx(11.0)
    assert summary["total_throughput"] == pytest.approx(111.0)
    assert summary["ttft"]["mean"] == pytest.approx(0.4)
    assert summary["tpot"]["p50"] == pytest.approx(((1.0 - 0.5) / 10 + (1.0 - 0.3) / 10) / 2)
    assert summary["itl"]["count"] == 20
    assert summary["itl"]["min"] == pytest.approx(0.05) and summary["itl"]["max"] == pytest.approx(0.07)
    assert summary["e2e"]["p50"] == pytest.approx(1.0)
    assert measured_duration([first]) == pytest.approx(1.0)


def test_token_cross_checks_count_mismatches_missing_usage_and_short_outputs():
    exact = record("a", prompt=10, output=3, max_tokens=3)
    exact.expected_prompt_tokens, exact.client_output_tokens = 10, 3
    lying = record("b", prompt=11, output=2, max_tokens=3)
    lying.expected_prompt_tokens, lying.client_output_tokens = 10, 3
    no_usage = record("c", prompt=None, output=None, max_tokens=3)
    no_usage.client_output_tokens = 3  # the fallback for TPOT and throughput
    tokens = summarize([exact, lying, no_usage])["tokens"]
    assert tokens["prompt_checked"] == 2 and tokens["prompt_mismatches"] == 1
    assert tokens["output_client_over_server"] == pytest.approx(6 / 5)
    assert tokens["usage_missing"] == 1
    assert tokens["short_outputs"] == 1


def test_slo_parsing_and_goodput():
    assert parse_slo("ttft=200ms,tpot=50,e2e=2s") == {"ttft": 0.2, "tpot": 0.05, "e2e": 2.0}
    with pytest.raises(ValueError):
        parse_slo("latency=3")
    fast = record("fast", chunks=[0.1, 0.12, 0.14], end=0.14)  # TPOT 20 ms
    slow_start = record("slow", sent=1.0, chunks=[0.5, 0.52, 0.54], end=0.54)
    failed = record("bad", error="timeout")
    slo = {"ttft": 0.2, "tpot": 0.03}
    assert meets_slo(fast, slo) and not meets_slo(slow_start, slo) and not meets_slo(failed, slo)
    goodput = summarize([fast, slow_start, failed], slo=slo)["goodput"]
    assert goodput["good_requests"] == 1 and goodput["fraction"] == pytest.approx(1 / 3)
    assert goodput["requests_per_s"] == pytest.approx(1 / 1.54)


def test_client_verdict_fires_on_dispatch_lag_or_loop_lag_and_not_otherwise():
    calm = client_verdict([0.001] * 50, [0.002] * 100, 0.1, tolerance_s=0.02)
    assert not calm["behind"] and calm["reasons"] == []
    late = client_verdict([0.001] * 50 + [0.3] * 5, [0.002] * 100, 0.1, tolerance_s=0.02)
    assert late["behind"] and "dispatch lag" in late["reasons"][0]
    stalled = client_verdict([], [0.002] * 90 + [0.2] * 10, 0.1, tolerance_s=0.02)
    assert stalled["behind"] and "event loop stalled" in stalled["reasons"][0]
    busy = client_verdict([], [0.001], 0.97, tolerance_s=0.02)
    assert not busy["behind"] and "CPU" in busy["warnings"][0]


def test_client_lag_tolerance_grows_with_the_interval_it_distorts():
    stalls = [0.002] * 90 + [0.05] * 10  # 50 ms stalls
    assert client_verdict([], stalls, None, 0.02, relative=0.05, itl_p50=0.1)["behind"]  # chunks 100 ms apart
    assert not client_verdict([], stalls, None, 0.02, relative=0.05, itl_p50=2.0)["behind"]  # 2 s apart: 2.5%
    late = [0.05] * 10
    assert client_verdict(late, [], None, 0.02, relative=0.05, mean_interarrival=0.1)["behind"]
    verdict = client_verdict(late, [], None, 0.02, relative=0.05, mean_interarrival=5.0)
    assert not verdict["behind"] and verdict["tolerance_s"]["dispatch"] == pytest.approx(0.25)


# --- arrivals and sweeps -----------------------------------------------------------------------------------


def test_constant_arrivals_are_exact_offsets_from_one_start():
    assert arrival_offsets(4, 2.0, "constant", 1.0, random.Random(0)) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, float("inf"), "poisson", 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("arrival, burstiness, cv", [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4, 0.5)])
def test_random_arrivals_have_the_asked_rate_and_burstiness(arrival, burstiness, cv):
    offsets = arrival_offsets(20001, 10.0, arrival, burstiness, random.Random(1))
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert offsets[:50] == arrival_offsets(50, 10.0, arrival, burstiness, random.Random(1))  # seeded


def test_load_spec_validation_and_labels():
    assert LoadSpec(concurrency=4).label() == "concurrency 4"
    assert LoadSpec(rate=2, arrival="gamma", burstiness=0.5, max_concurrency=8).label() == \
        "rate 2/s gamma k=0.5, cap 8"
    for bad in ({}, {"concurrency": 1, "rate": 1.0}, {"concurrency": 0}, {"rate": 1.0, "arrival": "weibull"}):
        with pytest.raises(ValueError):
            LoadSpec(**bad)


def test_sweep_levels_and_saturation_rule():
    assert parse_levels("1, 2,4", integer=True) == [1, 2, 4]
    assert parse_levels("0.5,inf", integer=False) == [0.5, float("inf")]
    assert doubling_levels(1, 20) == [1, 2, 4, 8, 16]

    def point(level, throughput, errors=0, behind=False):
        summary = {"output_throughput": throughput, "num_requests": 10, "num_errors": errors}
        return {"level": level, "summary": summary, "client": {"behind": behind}}

    assert saturation_reason([point(1, 10.0)], 0.05, 0.1) is None
    assert saturation_reason([point(1, 10.0), point(2, 19.0)], 0.05, 0.1) is None
    flat_once = [point(1, 10), point(2, 19), point(4, 19.5)]
    assert saturation_reason(flat_once, 0.05, 0.1) is None  # one flat level: could be noise or a code path
    assert "levels 4" in saturation_reason(flat_once, 0.05, 0.1, patience=1)
    flat_twice = [*flat_once, point(8, 18.0)]
    assert "saturated: output throughput at levels 4, 8 grew +2.6%, -5.3%" in saturation_reason(flat_twice, 0.05, 0.1)
    assert saturation_reason([*flat_once, point(8, 25.0)], 0.05, 0.1) is None  # it grew again
    assert "failed" in saturation_reason([point(1, 10.0, errors=2)], 0.05, 0.1)
    assert "client fell behind" in saturation_reason([point(1, 10.0), point(2, 30.0, behind=True)], 0.05, 0.1)


def test_capacity_at_the_slo_is_the_highest_rate_before_the_first_level_that_misses_it():
    def point(level, fraction):
        goodput = {"fraction": fraction, "requests_per_s": (level or 0) * fraction, "slo_s": {"ttft": 2.0}}
        return {"level": level, "load": {"mode": "open"}, "summary": {"goodput": goodput}}

    capacity = slo_capacity([point(1, 1.0), point(2, 0.95), point(4, 0.9), point(8, 0.6)], 0.9)
    assert (capacity["level"], capacity["unit"], capacity["goodput_requests_per_s"]) == (4, "req/s", 3.6)
    # A noisy pass above a level that missed is not capacity.
    assert slo_capacity([point(1, 1.0), point(2, 0.8), point(4, 0.95)], 0.9)["level"] == 1
    assert slo_capacity([point(1, 0.5), point(2, 0.95)], 0.9)["level"] is None
    assert slo_capacity([point(2, 0.92), point(1, 1.0)], 0.95)["level"] == 1, "levels are taken in order"
    no_slo = {"level": 1, "load": {"mode": "open"}, "summary": {}}
    assert slo_capacity([no_slo], 0.9) is None


# --- workloads -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> ClientTokenizer:
    from pagoda.testing import make_tokenizer

    directory = tmp_path_factory.mktemp("bench-tokenizer")
    make_tokenizer(directory, vocab_size=512)
    return ClientTokenizer(directory)


def test_lengths_fixed_uniform_normal():
    rng = random.Random(0)
    assert sample_lengths(3, 100, "fixed", 0.5, rng) == [100, 100, 100]
    uniform = sample_lengths(2000, 100, "uniform", 0.2, rng)
    assert min(uniform) >= 80 and max(uniform) <= 120 and statistics.mean(uniform) == pytest.approx(100, rel=0.02)
    normal = sample_lengths(2000, 100, "normal", 0.1, rng)
    assert statistics.mean(normal) == pytest.approx(100, rel=0.02)
    assert statistics.stdev(normal) == pytest.approx(10, rel=0.1)
    assert min(sample_lengths(500, 2, "normal", 2.0, rng)) >= 1


def test_random_prompts_are_exact_length_ordinary_token_ids_and_seeded(tokenizer):
    spec = WorkloadSpec(input_len=50, input_dist="uniform", input_spread=0.5, output_len=7)
    conversations = build_workload(spec, 20, tokenizer, "completions", seed=3)
    assert conversations == build_workload(spec, 20, tokenizer, "completions", seed=3)
    assert conversations != build_workload(spec, 20, tokenizer, "completions", seed=4)
    for conversation in conversations:
        (turn,) = conversation.turns
        assert all(isinstance(t, int) and 5 <= t < 512 for t in turn.prompt)  # 0..4 are special
        assert turn.expected_prompt_tokens == len(turn.prompt) and 25 <= len(turn.prompt) <= 75
        assert turn.max_tokens == 7
    chat = build_workload(spec, 2, tokenizer, "chat", seed=3)
    assert isinstance(chat[0].turns[0].prompt, str) and chat[0].turns[0].expected_prompt_tokens is None


def test_shared_prefix_groups_share_their_prefix(tokenizer):
    spec = WorkloadSpec(kind="shared-prefix", input_len=10, num_prefix_groups=3, prefix_len=16)
    conversations = build_workload(spec, 30, tokenizer, "completions", seed=0)
    prefixes = {}
    for conversation in conversations:
        prompt = conversation.turns[0].prompt
        assert len(prompt) == 26
        prefixes.setdefault(conversation.group, set()).add(tuple(prompt[:16]))
    assert set(prefixes) == {0, 1, 2} and all(len(p) == 1 for p in prefixes.values())


def test_multi_turn_conversations_and_their_request_bodies(tokenizer):
    spec = WorkloadSpec(kind="multi-turn", input_len=8, num_turns=3)
    conversations = build_workload(spec, 7, tokenizer, "chat", seed=0)
    assert [len(c.turns) for c in conversations] == [3, 3, 1]
    conversation = conversations[0]
    chat = Endpoint.parse("http://h:1/v1", api="chat", model="m")
    body = request_body(chat, conversation, 2, ["A1", "A2"], RequestOptions(ignore_eos=True))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    assert body["messages"][1]["content"] == "A1" and body["messages"][4]["content"] == conversation.turns[2].prompt
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    completions = Endpoint.parse("http://h:1", model="m")
    body = request_body(completions, conversation, 1, ["A1"], RequestOptions())
    assert body["prompt"] == conversation.turns[0].prompt + "A1" + conversation.turns[1].prompt
    assert "ignore_eos" not in body  # only sent when asked: a strict server may refuse it


def test_jsonl_workload(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "max_tokens": 5}, {"prompt_token_ids": [7, 8, 9]},
             {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n", encoding="utf-8")
    spec = WorkloadSpec(kind="jsonl", path=str(path), output_len=4)
    conversations = build_workload(spec, 3, tokenizer, "completions", seed=0)
    assert [c.turns[0].prompt for c in conversations] == ["hello there", [7, 8, 9], "hello there"]
    assert [c.turns[0].max_tokens for c in conversations] == [5, 4, 5]
    assert conversations[0].turns[0].expected_prompt_tokens == len(tokenizer.encode("hello there"))
    path.write_text(json.dumps(lines[2]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="--api chat"):
        build_workload(spec, 1, tokenizer, "completions", seed=0)
    assert build_workload(spec, 1, None, "chat", seed=0)[0].turns[0].prompt == lines[2]["messages"]


# --- the wire --------------------------------------------------------------------------------------------


def test_sse_lines_and_chunk_content():
    assert parse_event("data: [DONE]") == "[DONE]"
    assert parse_event(": keep-alive") is None and parse_event("") is None
    assert chunk_content(parse_event('data: {"choices": [{"text": "hi"}]}')) == "hi"
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}}]}) == ""  # a role chunk is not content
    assert chunk_content({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_content({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_endpoint_urls():
    assert Endpoint.parse("http://127.0.0.1:8000/v1").root == "http://127.0.0.1:8000"
    assert Endpoint.parse("127.0.0.1:8000").url == "http://127.0.0.1:8000/v1/completions"
    named = Endpoint.parse("vllm=https://host/base/v1/chat/completions", api="chat")
    assert (named.name, named.root, named.url) == ("vllm", "https://host/base", "https://host/base/v1/chat/completions")
    assert Endpoint.parse("http://h:1", api_key="k").headers == {"Authorization": "Bearer k"}


def test_messages_prompt_needs_chat():
    conversation = Conversation(0, [Turn([{"role": "user", "content": "x"}], 3)])
    with pytest.raises(ValueError):
        request_body(Endpoint.parse("http://h"), conversation, 0, [], RequestOptions())
