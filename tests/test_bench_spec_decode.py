"""`pagoda bench`'s speculative-decoding figures: the pure parse, delta and rates of two hand-written /metrics
texts, and end to end against a real `pagoda serve` with n-gram speculation (and one without)."""

from __future__ import annotations

import json

import pytest
from server_fixtures import make_server_checkpoint, start_server

from pagoda.bench import cli
from pagoda.bench.report import render
from pagoda.bench.spec_decode import SpecCounters, counters_delta, parse_spec_counters, spec_decode_window

pytestmark = pytest.mark.timeout(120)

# As a vLLM or pagoda server writes them: counters end in _total, one series per model (and per engine in a
# data-parallel vLLM, summed here), with other families around.
BEFORE = """\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# HELP vllm:spec_decode_num_drafts_total Drafts checked.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Draft tokens checked.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Draft tokens accepted.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted, by position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0
"""

# 20 more drafts of 3 tokens: 60 draft tokens, 16 + 10 + 4 = 30 accepted (engine 1 had none before).
AFTER = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 75.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 15.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 35.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 7.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 19.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 1.0
"""

NO_SPEC = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 120.0
"""


# --- pure: parse, delta, rates -------------------------------------------------------------------------------


def test_parse_sums_series_and_orders_positions():
    assert parse_spec_counters(BEFORE) == SpecCounters(10, 30, 12, (7, 4, 1))
    assert parse_spec_counters(AFTER) == SpecCounters(30, 90, 42, (23, 14, 5))  # _created is no count


def test_a_window_gives_vllms_acceptance_rate_mean_length_and_per_position_rates():
    window = spec_decode_window(BEFORE, AFTER)
    assert window == {
        "num_drafts": 20,
        "num_draft_tokens": 60,
        "num_accepted_tokens": 30,
        "acceptance_rate": pytest.approx(30 / 60),
        "mean_acceptance_length": pytest.approx(1 + 30 / 20),
        "per_position_acceptance_rate": pytest.approx([16 / 20, 10 / 20, 4 / 20]),
    }


@pytest.mark.parametrize("before, after", [
    (NO_SPEC, NO_SPEC),  # a server that does not speculate
    (None, AFTER),  # /metrics failed or 404
    (BEFORE, "<html><body>not here</body></html>"),  # not Prometheus text
    (BEFORE, BEFORE),  # no draft checked in the window
    (AFTER, BEFORE),  # counters went down: the server restarted in between
])
def test_no_window_without_counters_or_drafts(before, after):
    assert spec_decode_window(before, after) is None


def test_a_position_missing_before_counts_from_zero():
    delta = counters_delta(SpecCounters(1, 2, 1, (1,)), SpecCounters(3, 6, 3, (2, 1)))
    assert delta == SpecCounters(2, 4, 2, (1, 1))


def test_the_report_shows_a_speculative_table_only_when_a_level_has_one():
    def level(speculative):
        summary = {key: None for key in ("request_throughput", "output_throughput", "total_throughput")}
        summary |= {"num_ok": 1, "num_errors": 0, "num_requests": 1, "errors": {}, "input_tokens": 1,
                    "tokens": {"short_outputs": 0, "usage_missing": 0, "prompt_mismatches": 0,
                               "output_client_over_server": None},
                    **{name: {"count": 0, **dict.fromkeys(("mean", "p50", "p90", "p95", "p99"))}
                       for name in ("ttft", "tpot", "itl", "e2e")}}
        return {"label": "concurrency 1", "summary": summary, "warmup": {}, "speculative": speculative,
                "client": {"behind": False, "reasons": [], "warnings": []}}

    text = render([{"name": "spec", "levels": [level(spec_decode_window(BEFORE, AFTER))]}])
    assert "mean accept len" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["spec"] and "50.0%" in line)
    assert row.split()[3:] == ["20", "60", "30", "50.0%", "2.50", "0.80", "0.50", "0.20"]
    assert "mean accept len" not in render([{"name": "plain", "levels": [level(None)]}])


# --- end to end: `pagoda bench` against `pagoda serve` --------------------------------------------------------

MODEL = "spec-tiny"
# n-grams down to one token: on short random prompts a 5-token lookup (the default) seldom finds a draft
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # weights at std 0.1: greedy output falls into loops, so n-gram lookup finds drafts and some are right
    return make_server_checkpoint(tmp_path_factory.mktemp("bench-spec") / "model", init_std=0.1)


def serve(model_dir, log_dir, *args: str):
    return start_server(model_dir, log_dir, "--num-kv-blocks", "64", "--block-size", "16", "--max-num-seqs", "4",
                        "--no-use-kernels", *args, served_model_name=MODEL)  # no native-kernel build in a test


def bench(url: str, model_dir, out, *args: str) -> dict:
    code = cli.main(["--base-url", url, "--tokenizer", str(model_dir), "--input-len", "16", "--output-len", "24",
                     "--ignore-eos", "--num-requests", "2", "--warmup", "1", "--no-progress", "--no-plot",
                     "--out", str(out), "--timeout", "60", *args])
    assert code == 0
    return json.loads(out.read_text())


def test_bench_reports_acceptance_from_a_speculating_server(model_dir, tmp_path, capsys):
    server = serve(model_dir, tmp_path, "--speculative-config", NGRAM)
    try:
        doc = bench(server.url, model_dir, tmp_path / "spec.json", "--concurrency", "1,2", "--no-stop-at-saturation")
        metrics = server.metrics()
    finally:
        server.stop()
    levels = doc["endpoints"][0]["levels"]
    assert len(levels) == 2
    for point in levels:
        spec = point["speculative"]
        assert spec is not None and spec["num_drafts"] > 0, point
        assert 0 <= spec["acceptance_rate"] <= 1
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
        assert len(spec["per_position_acceptance_rate"]) == 3
        assert all(0 <= rate <= 1 for rate in spec["per_position_acceptance_rate"])
    # the levels' windows cover the measured requests only: together no more than the server's totals
    assert sum(p["speculative"]["num_drafts"] for p in levels) <= metrics.value("vllm:spec_decode_num_drafts_total")
    assert "mean accept len" in capsys.readouterr().out


def test_a_server_without_speculation_gives_no_section(model_dir, tmp_path, capsys):
    server = serve(model_dir, tmp_path)
    try:
        doc = bench(server.url, model_dir, tmp_path / "plain.json")
    finally:
        server.stop()
    (point,) = doc["endpoints"][0]["levels"]
    assert point["summary"]["num_ok"] == 2 and "speculative" in point and point["speculative"] is None
    assert "mean accept len" not in capsys.readouterr().out
