"""vLLM's per-request histograms and vllm:iteration_tokens_total on /metrics, with vLLM's names and buckets,
from the timeline the engine records for each request; and the `priority` field on a priority server."""

from __future__ import annotations

import pytest
from server_fixtures import make_server_checkpoint, start_server

from pagoda.server.metrics import TPOT_BUCKETS, token_count_buckets

MODEL = "tiny"
MAX_MODEL_LEN = 256
TIME_HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_time_per_output_token_seconds")
TOKEN_HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens")
ITERATION = "vllm:iteration_tokens_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("request-metrics")
    model_dir = make_server_checkpoint(root / "model", max_position_embeddings=MAX_MODEL_LEN)
    server = start_server(model_dir, root, "--num-kv-blocks", "128", "--block-size", "4", "--max-num-seqs", "8",
                          "--max-num-batched-tokens", "256", "--max-model-len", str(MAX_MODEL_LEN),
                          "--scheduling-policy", "priority", served_model_name=MODEL)
    yield server
    server.stop()


def complete(client, prompt: list[int], max_tokens: int, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"ignore_eos": True, **extra})


def histogram(metrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram."""
    return metrics.value(f"{name}_count"), metrics.value(f"{name}_sum")


def bucket_bounds(metrics, name: str) -> list[float]:
    return sorted(float(labels["le"]) for labels in metrics.labels_of(f"{name}_bucket"))


def test_histograms_have_vllms_names_types_and_buckets(server, client):
    complete(client, [5, 6, 7], 2)
    metrics = server.wait_until_idle()
    for name in (*TIME_HISTOGRAMS, *TOKEN_HISTOGRAMS, ITERATION):
        assert metrics.families[name] == "histogram", name
    assert bucket_bounds(metrics, "vllm:request_time_per_output_token_seconds") == [*TPOT_BUCKETS, float("inf")]
    assert bucket_bounds(metrics, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, float("inf")]
    assert token_count_buckets(MAX_MODEL_LEN) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert bucket_bounds(metrics, ITERATION) == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                 float("inf")]


def test_each_finished_request_is_observed_once_with_its_timeline_and_sizes(server, client):
    before = server.wait_until_idle()
    prompts = [[40 + i, 41 + i, 42 + i, 43 + i, 44 + i] for i in range(3)]  # no prefix shared with other tests
    for prompt, max_tokens in zip(prompts, (1, 6, 9)):
        complete(client, prompt, max_tokens)
    after = server.wait_until_idle()

    def delta(name: str) -> tuple[float, float]:
        (count_after, sum_after), (count_before, sum_before) = histogram(after, name), histogram(before, name)
        return count_after - count_before, sum_after - sum_before

    assert delta("vllm:request_prompt_tokens") == (3, 15)
    assert delta("vllm:request_generation_tokens") == (3, 1 + 6 + 9)
    for name in TIME_HISTOGRAMS[:-1]:
        count, total = delta(name)
        assert count == 3 and total >= 0, name
    assert delta("vllm:request_time_per_output_token_seconds")[0] == 2, "a one-token request has no TPOT"
    # One clock, one timeline: prefill + decode = inference, and queue + inference fits inside end-to-end.
    prefill, decode = delta("vllm:request_prefill_time_seconds")[1], delta("vllm:request_decode_time_seconds")[1]
    inference = delta("vllm:request_inference_time_seconds")[1]
    assert prefill + decode == pytest.approx(inference)
    assert delta("vllm:request_queue_time_seconds")[1] + inference <= delta("vllm:e2e_request_latency_seconds")[1]
    assert delta("vllm:e2e_request_latency_seconds")[0] == 3


def test_iteration_tokens_counts_every_step_and_every_token_computed(server, client):
    before = server.wait_until_idle()
    complete(client, list(range(100, 150)), 8)  # 50 prompt tokens in one chunk, then 7 single-token decodes
    after = server.wait_until_idle()
    count = after.value(f"{ITERATION}_count") - before.value(f"{ITERATION}_count")
    total = after.value(f"{ITERATION}_sum") - before.value(f"{ITERATION}_sum")
    assert (count, total) == (8, 50 + 7)

    def in_bucket(metrics, le: str) -> float:
        return metrics.value(f"{ITERATION}_bucket", le=le)

    assert in_bucket(after, "1.0") - in_bucket(before, "1.0") == 7, "the decode steps"
    assert in_bucket(after, "64.0") - in_bucket(before, "64.0") == 8, "and the 50-token prefill step"


def test_priority_is_accepted_and_only_reorders(server, client):
    prompt = [7, 8, 9, 10]
    plain = complete(client, prompt, 6).choices[0].text
    assert complete(client, prompt, 6, priority=-3).choices[0].text == plain
    assert complete(client, prompt, 6, priority=5).choices[0].text == plain
