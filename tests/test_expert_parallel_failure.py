"""A served mixture of experts with expert parallelism: /metrics reports the load per expert and per rank, through
the official client's requests; and a rank that dies mid-stream (with half the experts, which every sparse layer's
all-to-all waits on) ends the engine as for tensor parallelism: the stream ends with an error within seconds,
/health turns 503, new requests get a 503 naming the rank, and once the server is stopped no process is left."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
from server_fixtures import start_server, wait_until
from test_tensor_parallel import wait_gone
from test_tensor_parallel_failure import DETECTION_S, descendants, rank_pids

from pagoda.model.loader import load_model_config


def test_served_expert_parallelism_counts_its_load_and_a_dead_rank_ends_it(checkpoint, tmp_path):
    model_dir = checkpoint("mixtral")
    moe = load_model_config(model_dir).moe
    assert moe is not None
    server = start_server(model_dir, tmp_path, "--tensor-parallel-size", "2", "--enable-expert-parallel",
                          "--num-kv-blocks", "256", "--block-size", "4", served_model_name="moe")
    try:
        everything = descendants(server.process.pid)
        (rank,) = rank_pids(server.process.pid)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        completion = client.completions.create(model="moe", prompt=[5, 77, 123, 300], max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 6
        metrics = server.metrics()
        experts = [metrics.value("pagoda:moe_expert_tokens_total", expert=str(e)) for e in range(moe.num_experts)]
        ranks = [metrics.value("pagoda:moe_rank_tokens_total", rank=str(r)) for r in range(2)]
        # The warm-up's steps count too: at least this request's 4 + 5 computed tokens, each in every sparse layer.
        assert sum(experts) >= moe.top_k * moe.num_sparse_layers * (4 + 5)
        assert sum(experts) % (moe.top_k * moe.num_sparse_layers) == 0
        half = moe.num_experts // 2
        assert ranks == [sum(experts[:half]), sum(experts[half:])] and min(ranks) > 0

        body = {"model": "moe", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    os.kill(rank, signal.SIGKILL)
                    killed_at = time.monotonic()
                events.append(line.removeprefix("data: "))
        ended_after = time.monotonic() - killed_at
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] >= 500
        assert ended_after < DETECTION_S, f"the stream ended {ended_after:.1f} s after the rank died"
        assert len(events) < 200, "the stream ran on after its rank died"
        wait_until(lambda: server.health() == 503, DETECTION_S - (time.monotonic() - killed_at), "/health 503")
        refused = server.post("/v1/completions", {"model": "moe", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "rank 1 exited" in refused.json()["error"]["message"]
    finally:
        server.stop()
    assert wait_gone([server.process.pid, *everything]) == []
