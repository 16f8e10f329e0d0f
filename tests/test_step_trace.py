"""The engine's step timeline (engine/step_trace.py): a valid Trace Event Format document of 32 streams, phases
nested in their steps and adding up to them, every step and every request in it and counted right; the same
through `pagoda generate --trace-file`, and through `pagoda serve --profile-dir`'s /start_profile and
/stop_profile (with the server's publish between steps), which `pagoda bench --profile` drives."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import random_prompts
from server_fixtures import make_server_checkpoint, start_server

from pagoda import LLM, SamplingParams
from pagoda.bench import cli as bench_cli
from pagoda.cli import main

pytestmark = pytest.mark.timeout(180)

NUM_STREAMS = 32
COMPLETE_FIELDS = {"name", "ph", "ts", "dur", "pid", "tid"}
SLACK_US = 1.0  # float rounding of microsecond times


def check_document(document: dict, sampled: bool = True) -> tuple[list[dict], list[dict], list[dict]]:
    """The trace's steps, phases and parts, after checking the format and the nesting (sampled: some step
    sampled tokens; an embedding model's steps only pool)."""
    events = document["traceEvents"]
    assert events and all({"ph", "pid", "name"} <= set(e) for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert all(set(e) >= COMPLETE_FIELDS and e["dur"] >= 0 for e in complete)
    json.dumps(document)  # plain JSON
    steps = [e for e in complete if e["cat"] == "step"]
    phases = [e for e in complete if e["cat"] == "phase"]
    parts = [e for e in complete if e["cat"] == "part"]
    assert steps
    for step in steps:
        inside = [p for p in phases if step["ts"] - SLACK_US <= p["ts"] <= step["ts"] + step["dur"] + SLACK_US]
        assert [p["name"] for p in inside] == ["schedule", "execute", "update", "outputs"]
        for phase in inside:
            assert phase["ts"] + phase["dur"] <= step["ts"] + step["dur"] + SLACK_US
        # Laid end to end, the phases are the step (within 2%).
        assert sum(p["dur"] for p in inside) == pytest.approx(step["dur"], rel=0.02)
    executes = [p for p in phases if p["name"] == "execute"]
    for part in parts:
        assert any(e["ts"] - SLACK_US <= part["ts"] and part["ts"] + part["dur"] <= e["ts"] + e["dur"] + SLACK_US
                   for e in executes), part
    assert {p["name"] for p in parts} >= {"prepare", "forward"} | ({"sample"} if sampled else set())
    return steps, phases, parts


def request_events(document: dict) -> dict[str, dict[str, dict]]:
    tracks: dict[str, dict[str, dict]] = {}
    for event in document["traceEvents"]:
        if event.get("cat") == "request":
            tracks.setdefault(event["id"], {})[event["ph"]] = event
    return tracks


def test_a_trace_of_32_streams_is_valid_nested_and_counts_every_step_and_request(checkpoint):
    llm = LLM(str(checkpoint("llama")), max_num_batched_tokens=64, max_num_seqs=NUM_STREAMS)
    prompts = random_prompts([5 + 3 * i for i in range(NUM_STREAMS)])
    params = [SamplingParams(max_tokens=2 + i % 7, ignore_eos=True) for i in range(NUM_STREAMS)]
    steps_before = sum(llm.engine.stats().iteration_token_counts)
    llm.start_profile()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    document = llm.stop_profile()
    steps, _, _ = check_document(document)
    assert len(steps) == sum(llm.engine.stats().iteration_token_counts) - steps_before
    # Every token the steps computed: each prompt, and each output token but the last (never fed back).
    assert sum(s["args"]["tokens"] for s in steps) == sum(
        len(p) + len(o.outputs[0].token_ids) - 1 for p, o in zip(prompts, outputs))
    tracks = request_events(document)
    assert len(tracks) == NUM_STREAMS
    for track in tracks.values():
        assert set(track) == {"b", "n", "e"}
        assert track["b"]["ts"] <= track["n"]["ts"] <= track["e"]["ts"]
    assert llm.stop_profile()["traceEvents"] == []  # stopped: nothing more is recorded
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    assert llm.engine.trace.stop()["traceEvents"] == []


def test_generate_writes_its_trace_file(checkpoint, tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["generate", "--model", str(checkpoint("llama")), "--raw", "--max-tokens", "5", "hello",
                 "--trace-file", str(path)]) == 0
    steps, _, _ = check_document(json.loads(path.read_text()))
    assert len(steps) == 5  # one prefill step, then one step per further token
    assert "wrote the steps' timeline" in capsys.readouterr().err


def test_serve_profile_routes_record_streams_and_bench_drives_them(tmp_path):
    model_dir = make_server_checkpoint(tmp_path / "model")
    profiles = tmp_path / "profiles"
    server = start_server(model_dir, tmp_path, "--profile-dir", str(profiles), "--no-use-kernels",
                          served_model_name="tiny")
    try:
        assert server.post("/start_profile").status_code == 200

        def stream(index: int) -> None:
            body = {"model": "tiny", "prompt": [5 + index, 6, 7], "max_tokens": 4, "ignore_eos": True,
                    "stream": True}
            with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                list(response.iter_lines())

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(stream, range(NUM_STREAMS)))
        answer = server.post("/stop_profile").json()
        document = json.loads(Path(answer["trace_file"]).read_text())
        check_document(document)
        assert len(request_events(document)) == NUM_STREAMS
        assert any(e.get("name") == "publish" for e in document["traceEvents"])

        out = tmp_path / "bench.json"
        assert bench_cli.main(["--base-url", f"{server.url}/v1", "--tokenizer", str(model_dir), "--input-len", "8",
                               "--output-len", "4", "--num-requests", "4", "--warmup", "0", "--no-progress",
                               "--no-plot", "--profile", "--out", str(out)]) == 0
        [level] = json.loads(out.read_text())["endpoints"][0]["levels"]
        traced = json.loads(Path(level["profile"]["trace_file"]).read_text())
        assert len(request_events(traced)) == 4
    finally:
        server.stop()
    plain = start_server(model_dir, tmp_path, "--no-use-kernels", served_model_name="tiny")
    try:
        assert httpx.post(f"{plain.url}/start_profile", timeout=10).status_code == 404
    finally:
        plain.stop()


def test_embedding_requests_have_their_tracks_too(checkpoint):
    llm = LLM(str(checkpoint("llama")), runner="pooling", max_num_batched_tokens=32)
    prompts = random_prompts([4 + 5 * i for i in range(8)])
    llm.start_profile()
    outputs = llm.embed(prompts)
    document = llm.stop_profile()
    steps, _, _ = check_document(document, sampled=False)
    assert len(outputs) == 8 and all(output.outputs.embedding for output in outputs)
    assert sum(s["args"]["tokens"] for s in steps) == sum(map(len, prompts))  # prompts only: nothing decodes
    tracks = request_events(document)
    assert len(tracks) == 8 and all({"b", "e"} <= set(track) for track in tracks.values())
