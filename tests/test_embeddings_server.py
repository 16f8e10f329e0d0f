"""POST /v1/embeddings end to end: `pagoda serve --runner pooling` driven by the official `openai` client
(base64 by default, float when asked), compared with the offline LLM.embed; its 400s; and each runner's
refusal of the other's routes."""

from __future__ import annotations

import openai
import pytest
import torch
from embedding_models import embedding_model
from server_fixtures import assert_openai_error, launch_router, make_server_checkpoint, start_server

pytestmark = pytest.mark.timeout(120)

MODEL = "pagoda-embed"
MAX_MODEL_LEN = 64
INPUTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed-model")
    base = make_server_checkpoint(root / "base")
    return embedding_model(base, root / "model", "mean", True, matryoshka=[16, 32])


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(model_dir, tmp_path_factory.mktemp("embed-server"), "--runner", "pooling",
                          "--num-kv-blocks", "64", "--block-size", "4", "--max-num-batched-tokens", "8",
                          "--max-model-len", str(MAX_MODEL_LEN), served_model_name=MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    from pagoda import LLM

    llm = LLM(str(model_dir), runner="pooling", num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.close()


def _close(actual, expected) -> None:
    error = (torch.tensor(actual) - torch.tensor(expected)).abs().max().item()
    assert len(actual) == len(expected) and error <= TOLERANCE, error


def test_openai_client_base64_and_float_equal_offline_embed(server, offline):
    client = server.client()
    expected = offline.embed(INPUTS)
    for kwargs in ({}, {"encoding_format": "float"}):  # the client asks for base64 unless told otherwise
        answer = client.embeddings.create(model=MODEL, input=INPUTS, **kwargs)
        assert answer.object == "list" and answer.model == MODEL
        assert [item.index for item in answer.data] == [0, 1, 2]
        for item, output in zip(answer.data, expected):
            assert item.object == "embedding"
            _close(item.embedding, output.outputs.embedding)
        assert answer.usage.prompt_tokens == sum(len(output.prompt_token_ids) for output in expected)
        assert answer.usage.total_tokens == answer.usage.prompt_tokens


def test_the_wire_carries_base64_of_little_endian_float32(server, offline):
    import base64
    import struct

    body = server.post("/v1/embeddings", {"model": MODEL, "input": "Hello world", "encoding_format": "base64"}).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    _close(list(vector), offline.embed("Hello world")[0].outputs.embedding)
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}


def test_token_id_inputs_one_or_many(server, offline):
    ids = [[5, 6, 7, 8, 9], [10, 11]]
    answer = server.client().embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for item, output in zip(answer.data, offline.embed(ids)):
        _close(item.embedding, output.outputs.embedding)
    one = server.client().embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 5


def test_dimensions_truncate_and_renormalize(server, offline):
    from pagoda.pooling import PoolingParams

    answer = server.client().embeddings.create(model=MODEL, input=INPUTS, dimensions=16, encoding_format="float")
    for item, output in zip(answer.data, offline.embed(INPUTS, PoolingParams(dimensions=16))):
        assert len(item.embedding) == 16
        assert abs(torch.tensor(item.embedding).norm().item() - 1) < 1e-5
        _close(item.embedding, output.outputs.embedding)
    assert_openai_error(server.post("/v1/embeddings", {"model": MODEL, "input": "hi", "dimensions": 8}), 400,
                        param="dimensions", contains=["[16, 32]"])


@pytest.mark.parametrize("value, contains", [
    ([], "empty"), ("", "empty"), (["fine", ""], "input[1]"), ([[]], "empty"),
    ([3, 512], "[0, 512)"), ([5] * (MAX_MODEL_LEN + 1), "maximum context length"),
])
def test_bad_input_is_a_400_naming_input(server, value, contains):
    response = server.post("/v1/embeddings", {"model": MODEL, "input": value})
    assert_openai_error(response, 400, param="input", contains=[contains])


def test_the_client_raises_bad_request_for_bad_input(server):
    with pytest.raises(openai.BadRequestError, match="empty"):
        server.client().embeddings.create(model=MODEL, input=[])


def test_a_pooling_server_refuses_generation(server):
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})):
        assert_openai_error(server.post(path, body), 400, param="model", contains=["pooling runner"])
    assert server.post("/v1/embeddings", {"model": "other", "input": "hi"}).status_code == 404


def test_a_generate_server_refuses_embeddings(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate-server")
    generate = start_server(make_server_checkpoint(root / "model"), root, "--num-kv-blocks", "32",
                            served_model_name=MODEL)
    try:
        response = generate.post("/v1/embeddings", {"model": MODEL, "input": "hi"})
        assert_openai_error(response, 400, param="model", contains=["does not support the Embeddings API",
                                                                     "--runner pooling"])
    finally:
        generate.stop()


def test_the_router_serves_embeddings_from_its_replica(server, offline, tmp_path):
    router = launch_router([server.url], tmp_path, served_model_name=MODEL)
    try:
        router.wait_for_health(200)
        answer = router.client().embeddings.create(model=MODEL, input=INPUTS, encoding_format="float")
        for item, output in zip(answer.data, offline.embed(INPUTS)):
            _close(item.embedding, output.outputs.embedding)
    finally:
        router.stop()
