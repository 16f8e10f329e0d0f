"""`pagoda bench` against a real `pagoda serve` on loopback (a tiny random Llama; small bounded loads).

What a real server must give back: exact prompt lengths (token ids for completions, /tokenize for chat),
output lengths forced by ignore_eos, usage that agrees with the client's counts, and timings that hang
together (TTFT < E2E, TPOT > 0, one ITL per gap).
"""

from __future__ import annotations

import json

import pytest
from server_fixtures import make_server_checkpoint, start_server

from pagoda.bench import cli

pytestmark = pytest.mark.timeout(120)

MODEL = "bench-tiny"
INPUT_LEN = 24
OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_server_checkpoint(tmp_path_factory.mktemp("bench-server") / "model")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(model_dir, tmp_path_factory.mktemp("bench-server-logs"), "--num-kv-blocks", "128",
                          "--block-size", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                          "--no-use-kernels", served_model_name=MODEL)  # no native-kernel build in a test
    yield server
    server.stop()


def bench(server, model_dir, out, *args: str) -> dict:
    code = cli.main(["--base-url", f"{server.url}/v1", "--tokenizer", str(model_dir), "--input-len", str(INPUT_LEN),
                     "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--warmup", "1", "--no-progress",
                     "--out", str(out), "--timeout", "60", *args])
    assert code == 0
    return json.loads(out.read_text())


def check_level(point: dict, num_requests: int, exact_prompts: bool) -> None:
    summary = point["summary"]
    assert summary["num_ok"] == num_requests, summary["errors"]
    assert not point["client"]["behind"] or point["client"]["reasons"]
    for request in point["requests"]:
        assert request["output_tokens"] == OUTPUT_LEN  # ignore_eos forces the length
        assert request["expected_prompt_tokens"] == request["prompt_tokens"]
        if exact_prompts:
            assert request["prompt_tokens"] == INPUT_LEN
        ttft, e2e = request["chunk_times"][0], request["end"]
        assert 0 < ttft <= e2e
    assert summary["tokens"]["prompt_mismatches"] == 0 and summary["tokens"]["short_outputs"] == 0
    assert summary["tpot"]["count"] == num_requests and summary["tpot"]["min"] > 0
    assert summary["itl"]["count"] == sum(len(r["chunk_times"]) - 1 for r in point["requests"])
    assert summary["output_tokens"] == num_requests * OUTPUT_LEN
    assert summary["output_throughput"] > 0 and summary["total_throughput"] > summary["output_throughput"]


def test_closed_loop_sweep_on_completions(server, model_dir, tmp_path):
    doc = bench(server, model_dir, tmp_path / "sweep.json", "--concurrency", "1,2", "--num-requests", "4",
                "--no-stop-at-saturation")
    (endpoint,) = doc["endpoints"]
    assert endpoint["model"] == MODEL and endpoint["tokenize"] is True and endpoint["server_version"]
    assert [p["level"] for p in endpoint["levels"]] == [1, 2]
    for point in endpoint["levels"]:
        check_level(point, 4, exact_prompts=True)
    # level i uses seed + i: the second level's prompts are new, none found in the prefix cache
    assert all(r["cached_tokens"] == 0 for r in endpoint["levels"][1]["requests"])
    assert doc["config"]["levels"][1]["concurrency"] == 2
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_open_loop_chat_counts_prompts_with_tokenize(server, model_dir, tmp_path):
    doc = bench(server, model_dir, tmp_path / "chat.json", "--api", "chat", "--request-rate", "50",
                "--arrival", "gamma", "--burstiness", "0.5", "--max-concurrency", "2", "--num-requests", "3",
                "--no-plot")
    (point,) = doc["endpoints"][0]["levels"]
    check_level(point, 3, exact_prompts=False)  # chat: lengths from /tokenize and usage, checked equal
    assert point["load"]["mode"] == "open" and point["client"]["dispatch_lag"]["count"] == 3
    assert all(r["scheduled"] is not None for r in point["requests"])


def test_multi_turn_and_shared_prefix(server, model_dir, tmp_path):
    doc = bench(server, model_dir, tmp_path / "mt.json", "--workload", "multi-turn", "--num-turns", "2",
                "--num-requests", "4", "--concurrency", "2", "--no-plot")
    (point,) = doc["endpoints"][0]["levels"]
    assert point["summary"]["num_ok"] == 4
    turns = {r["request_id"]: r for r in point["requests"]}
    for conversation in (0, 1):  # the second turn resends the first turn and its answer: a longer prompt
        assert turns[f"c{conversation}-t1"]["prompt_tokens"] > turns[f"c{conversation}-t0"]["prompt_tokens"]
    doc = bench(server, model_dir, tmp_path / "sp.json", "--workload", "shared-prefix", "--prefix-len", "32",
                "--num-prefix-groups", "1", "--num-requests", "3", "--no-plot")
    (point,) = doc["endpoints"][0]["levels"]
    assert point["summary"]["num_ok"] == 3
    assert {r["prompt_tokens"] for r in point["requests"]} == {32 + INPUT_LEN}
    later = sorted(point["requests"], key=lambda r: r["sent"])[1:]  # concurrency 1: after the first one
    assert all(r["cached_tokens"] >= 32 for r in later)  # the shared 32-token prefix: two full 16-token blocks
    assert point["summary"]["tokens"]["cached_prompt_tokens"] >= 64


def test_a_rerun_finds_its_prompts_cached_and_says_so(server, model_dir, tmp_path, capsys):
    args = ("--seed", "77", "--num-requests", "2", "--warmup", "0", "--no-plot")
    first = bench(server, model_dir, tmp_path / "a.json", *args)["endpoints"][0]["levels"][0]
    again = bench(server, model_dir, tmp_path / "b.json", *args)["endpoints"][0]["levels"][0]
    assert first["summary"]["tokens"]["cached_prompt_tokens"] == 0
    assert again["summary"]["tokens"]["cached_prompt_tokens"] == 2 * 16  # one full 16-token block per prompt
    assert "prefix-cache hits" in capsys.readouterr().out
    cold = bench(server, model_dir, tmp_path / "c.json", *args, "--reset-prefix-cache")["endpoints"][0]["levels"][0]
    assert cold["prefix_cache_reset"] is True and cold["summary"]["tokens"]["cached_prompt_tokens"] == 0
