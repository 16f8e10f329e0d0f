"""LoRA adapters through the HTTP server: `--enable-lora --lora-modules`, a request picks an adapter by its `model`
name (the official openai client), /v1/models lists the adapters with their parent, an unknown name stays a 404,
vllm:lora_requests_info in /metrics, and a bad adapter fails the start naming it."""

from __future__ import annotations

import json
import time

import openai
import pytest
from lora_fixtures import make_adapter, peft_reference
from server_fixtures import launch_server, make_server_checkpoint, start_server, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL = "pagoda-lora-base"
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-lora")
    model_dir = make_server_checkpoint(root / "model")
    tuned = make_adapter(model_dir, root / "tuned", r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=1)
    other = make_adapter(model_dir, root / "other", r=4, alpha=8, targets=["gate_proj", "up_proj"], rslora=True,
                         seed=2)
    other_json = json.dumps({"name": "other", "path": str(other), "base_model_name": "the-base"})
    server = start_server(model_dir, root, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--num-kv-blocks", "64", "--block-size", "4",
                          "--lora-modules", f"tuned={tuned}", other_json, served_model_name=MODEL)
    try:
        yield server, model_dir, {"tuned": tuned, "other": other}, root
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(setup):
    return setup[0]


def test_a_request_picks_its_adapter_by_model_name(setup):
    server, model_dir, adapters, _ = setup
    with server.client() as client:
        for name in (MODEL, "tuned", "other"):
            completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"skip_special_tokens": False, "ignore_eos": True})
            assert completion.model == name
            reference = peft_reference(model_dir, None if name == MODEL else adapters[name], PROMPT, MAX_TOKENS)
            expected = server.post("/detokenize", {"tokens": reference.token_ids}).json()["prompt"]
            assert completion.choices[0].text == expected, f"{name}: not transformers + PEFT's output"
        chat = client.chat.completions.create(model="tuned", max_tokens=4, temperature=0,
                                              messages=[{"role": "user", "content": "hello"}])
        assert chat.model == "tuned" and chat.choices[0].message.content is not None


def test_the_responses_api_picks_an_adapter_too_and_a_continuation_keeps_it(setup):
    """/v1/responses is the chat route in other words: its `model` picks the adapter, its answer equals the chat
    route's on that adapter, and a continuation by previous_response_id runs on the adapter it names."""
    server = setup[0]
    with server.client() as client:
        for name in ("tuned", MODEL):
            chat = client.chat.completions.create(model=name, max_tokens=6, temperature=0,
                                                  messages=[{"role": "user", "content": "hello"}])
            response = client.responses.create(model=name, input="hello", max_output_tokens=6, temperature=0)
            assert response.model == name and response.output_text == chat.choices[0].message.content
        base = client.responses.create(model=MODEL, input="hello", max_output_tokens=6, temperature=0)
        tuned = client.responses.create(model="tuned", input="hello", max_output_tokens=6, temperature=0)
        assert base.output_text != tuned.output_text, "the adapter changes the answer"
        continued = client.responses.create(model="tuned", input="more", previous_response_id=tuned.id,
                                            max_output_tokens=6, temperature=0)
        expected = client.chat.completions.create(
            model="tuned", max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": "hello"}, {"role": "assistant", "content": tuned.output_text},
                      {"role": "user", "content": "more"}])
        assert continued.output_text == expected.choices[0].message.content


def test_models_lists_the_adapters_with_their_parent(setup):
    server, _, adapters, _ = setup
    with server.client() as client:
        cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [MODEL, "tuned", "other"]
    tuned, other = cards["tuned"].model_dump(), cards["other"].model_dump()
    assert tuned["parent"] == MODEL and tuned["root"] == str(adapters["tuned"])
    assert other["parent"] == "the-base" and other["root"] == str(adapters["other"])


def test_an_unknown_model_name_is_still_a_404(server):
    with server.client() as client, pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nobody", prompt=PROMPT, max_tokens=2)


def test_lora_requests_info_gauge(server):
    before = time.time()
    with server.client() as client:
        client.completions.create(model="tuned", prompt=PROMPT, max_tokens=2)

    def gauge():
        samples = [(dict(labels), value) for (name, labels), value in server.metrics().samples.items()
                   if name == "vllm:lora_requests_info"]
        return samples if samples and samples[0][1] >= before else None

    [(labels, value)] = wait_until(gauge, 10, "a vllm:lora_requests_info sample after the request")
    assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before <= value <= time.time() + 1


def test_a_streamed_request_shows_its_adapter_as_running(server):
    with server.client() as client:
        stream = client.completions.create(model="other", prompt=PROMPT, max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))

        def running():
            for (name, labels), _ in server.metrics().samples.items():
                if name == "vllm:lora_requests_info" and dict(labels)["running_lora_adapters"] == "other":
                    return True
            return False

        wait_until(running, 10, "the adapter among the running ones")
        stream.close()


def test_a_bad_adapter_fails_the_start_naming_it(setup, tmp_path):
    _, model_dir, adapters, root = setup
    wide = make_adapter(model_dir, tmp_path / "wide", r=16, alpha=16, targets=["q_proj"])
    process = launch_server(model_dir, tmp_path, "--enable-lora", "--max-lora-rank", "8", "--num-kv-blocks", "16",
                            "--lora-modules", f"wide={wide}")
    assert process.process.wait(timeout=120) == 1
    assert "rank 16 is over --max-lora-rank 8" in process.log_tail()


def test_lora_modules_needs_enable_lora(setup, tmp_path):
    _, model_dir, adapters, _ = setup
    process = launch_server(model_dir, tmp_path, "--lora-modules", f"tuned={adapters['tuned']}")
    assert process.process.wait(timeout=60) != 0
    assert "--lora-modules needs --enable-lora" in process.log_tail()
