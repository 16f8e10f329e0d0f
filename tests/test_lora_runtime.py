"""Adapters loaded and unloaded while serving: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter
behind --allow-runtime-lora-updating and the API key. A loaded adapter answers as transformers + PEFT do; a name
loaded again in place with other weights answers with the new ones even for a prompt whose blocks the old
weights filled (the prefix cache must not serve them); an unloaded name is a 404."""

from __future__ import annotations

import httpx
import openai
import pytest
from lora_fixtures import make_adapter, peft_reference
from server_fixtures import assert_openai_error, launch_server, make_server_checkpoint, start_server

pytestmark = pytest.mark.timeout(180)

MODEL = "pagoda-lora-base"
KEY = "runtime-key"
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 7, 19]  # 3 full blocks of 4: cached once computed
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    model_dir = make_server_checkpoint(root / "model")
    adapters = {name: make_adapter(model_dir, root / name, r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"],
                                   seed=seed) for name, seed in (("first", 1), ("second", 2))}
    server = start_server(model_dir, root, "--enable-lora", "--max-lora-rank", "8", "--num-kv-blocks", "64",
                          "--block-size", "4", "--allow-runtime-lora-updating", served_model_name=MODEL, api_key=KEY)
    try:
        yield server, model_dir, adapters
    finally:
        server.stop()


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def completion_text(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"skip_special_tokens": False, "ignore_eos": True})
    return answer.choices[0].text


def expected_text(server, model_dir, adapter_dir) -> str:
    reference = peft_reference(model_dir, adapter_dir, PROMPT, MAX_TOKENS)
    return post(server, "/detokenize", {"tokens": reference.token_ids}).json()["prompt"]


def test_load_serve_reload_in_place_and_unload(setup):
    server, model_dir, adapters = setup
    client = server.client(KEY)
    with pytest.raises(openai.NotFoundError):
        completion_text(client, "tuned")
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(adapters["first"])})
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'tuned' added successfully."
    cards = {card.id: card.model_dump() for card in client.models.list().data}
    assert cards["tuned"]["parent"] == MODEL and cards["tuned"]["root"] == str(adapters["first"])
    first = expected_text(server, model_dir, adapters["first"])
    assert completion_text(client, "tuned") == first
    assert completion_text(client, "tuned") == first  # its prompt blocks now cached

    again = post(server, "/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(adapters["second"])})
    assert "already been loaded" in assert_openai_error(again, 400, param="lora_name")["message"]
    assert completion_text(client, "tuned") == first

    replaced = post(server, "/v1/load_lora_adapter",
                    {"lora_name": "tuned", "lora_path": str(adapters["second"]), "load_inplace": True})
    assert replaced.status_code == 200, replaced.text
    second = expected_text(server, model_dir, adapters["second"])
    assert second != first, "the two adapters must differ for the reload to be seen"
    assert completion_text(client, "tuned") == second, "blocks of the old weights were served"

    removed = post(server, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'tuned' removed successfully."
    with pytest.raises(openai.NotFoundError):
        completion_text(client, "tuned")
    assert "tuned" not in [card.id for card in client.models.list().data]
    assert "cannot be found" in assert_openai_error(
        post(server, "/v1/unload_lora_adapter", {"lora_name": "tuned"}), 404, param="lora_name")["message"]


def test_bad_loads_are_400s_naming_the_field_and_need_the_key(setup, tmp_path):
    server, model_dir, adapters = setup
    wide = make_adapter(model_dir, tmp_path / "wide", r=16, alpha=16, targets=["q_proj"])
    error = assert_openai_error(post(server, "/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(wide)}),
                                400, param="lora_path")
    assert "rank 16 is over --max-lora-rank 8" in error["message"]
    assert_openai_error(post(server, "/v1/load_lora_adapter",
                             {"lora_name": "gone", "lora_path": str(tmp_path / "missing")}), 400, param="lora_path")
    assert_openai_error(post(server, "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": str(wide)}), 400,
                        param="lora_name")
    assert_openai_error(post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400, param="lora_path")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(wide)}, key=None).status_code \
        == 401
    assert [card.id for card in server.client(KEY).models.list().data] == [MODEL], "a failed load left a name"


def test_the_routes_exist_only_with_the_flag_which_needs_enable_lora(setup, tmp_path):
    _, model_dir, adapters = setup
    plain = start_server(model_dir, tmp_path, "--enable-lora", "--num-kv-blocks", "16", served_model_name=MODEL)
    try:
        body = {"lora_name": "tuned", "lora_path": str(adapters["first"])}
        assert post(plain, "/v1/load_lora_adapter", body, key=None).status_code == 404
    finally:
        plain.stop()
    refused = launch_server(model_dir, tmp_path, "--allow-runtime-lora-updating", "--num-kv-blocks", "16")
    assert refused.process.wait(timeout=60) != 0
    assert "--allow-runtime-lora-updating needs --enable-lora" in refused.log_tail()
