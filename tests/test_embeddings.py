"""The pooling runner offline: LLM.embed against transformers' pooled hidden states, exactly (fp32, 1e-5),
under batching, chunked prefill and preemption; its refusals; prefix caching as each pooling allows."""

from __future__ import annotations

import json
import random

import pytest
import torch
from embedding_models import HFEmbedder, embedding_model

from pagoda.engine.api import RequestRejected
from pagoda.model_dir import ModelLoadError
from pagoda.pooling import PoolingParams, load_pooling_config, resolve_runner
from pagoda.sampling import SamplingParams

TOLERANCE = 1e-5


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, the one-token prompt included (ids clear of the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 512) for _ in range(length)] for length in (1, 5, 13, 30, 22)]


def _assert_close(actual: list[float], expected: torch.Tensor, label: str) -> None:
    got = torch.tensor(actual)
    assert got.shape == expected.shape, label
    error = (got - expected).abs().max().item()
    assert error <= TOLERANCE, f"{label}: max abs error {error:.3g}"


@pytest.fixture(scope="module")
def embedder_cache():
    return {}


def _reference(cache, model_dir, arch):
    if arch not in cache:
        cache[arch] = HFEmbedder(model_dir)
    return cache[arch]


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
@pytest.mark.parametrize("method", ["last", "mean", "cls"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_match_transformers(arch, method, normalize, budget, checkpoint, make_llm, tmp_path,
                                       embedder_cache):
    model_dir = embedding_model(checkpoint(arch), tmp_path / "model", method, normalize)
    reference = _reference(embedder_cache, checkpoint(arch), arch)
    prompts = _prompts()
    llm = make_llm(model_dir, runner="pooling", max_num_batched_tokens=budget)
    outputs = llm.embed(prompts)
    for prompt, output in zip(prompts, outputs):
        _assert_close(output.outputs.embedding, reference.embed(prompt, method, normalize),
                      f"{arch} {method} len {len(prompt)}")
        assert output.prompt_token_ids == prompt and output.finished
    if normalize:  # a normalized vector is unit length; a raw one, here, is not
        assert abs(torch.tensor(outputs[2].outputs.embedding).norm().item() - 1) < 1e-5
    else:
        assert abs(torch.tensor(outputs[2].outputs.embedding).norm().item() - 1) > 1e-2


def test_without_sentence_transformers_files_last_token_normalized(checkpoint, make_llm, embedder_cache):
    """vLLM's default for decoder embedding models (Qwen3-Embedding): last token, normalized."""
    model_dir = checkpoint("qwen3")
    reference = _reference(embedder_cache, model_dir, "qwen3")
    prompts = _prompts(1)
    for prompt, output in zip(prompts, make_llm(model_dir, convert="embed").embed(prompts)):
        _assert_close(output.outputs.embedding, reference.embed(prompt, "last", True), f"len {len(prompt)}")


def test_string_prompts_are_tokenized_as_generate_does(checkpoint, make_llm, embedder_cache, tmp_path):
    model_dir = embedding_model(checkpoint("llama"), tmp_path / "model", "mean", True)
    llm = make_llm(model_dir, runner="pooling")
    texts = ["the quick brown fox", "a"]
    outputs = llm.embed(texts)
    reference = _reference(embedder_cache, checkpoint("llama"), "llama")
    for text, output in zip(texts, outputs):
        ids = llm.get_tokenizer().encode(text, add_special_tokens=True)
        assert output.prompt_token_ids == ids
        _assert_close(output.outputs.embedding, reference.embed(ids, "mean", True), text)


def test_preempted_prompts_are_pooled_once(checkpoint, make_llm, tmp_path, embedder_cache):
    """A pool too small for the batch preempts requests mid-prompt; mean pooling's running sum starts again."""
    model_dir = embedding_model(checkpoint("llama"), tmp_path / "model", "mean", False)
    reference = _reference(embedder_cache, checkpoint("llama"), "llama")
    prompts = _prompts(2)[2:] * 2
    # Each request computes at most 4 tokens a step, so two of 30 tokens grow side by side past the 10 blocks.
    llm = make_llm(model_dir, runner="pooling", num_kv_blocks=10, block_size=4, max_num_batched_tokens=8,
                   long_prefill_token_threshold=4)
    outputs = llm.embed(prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        _assert_close(output.outputs.embedding, reference.embed(prompt, "mean", False), f"len {len(prompt)}")


def test_last_token_pooling_takes_prefix_hits_mean_does_not(checkpoint, make_llm, tmp_path, embedder_cache):
    reference = _reference(embedder_cache, checkpoint("llama"), "llama")
    prompt = _prompts(3)[3]
    for method, hits in (("last", True), ("mean", False)):
        model_dir = embedding_model(checkpoint("llama"), tmp_path / method, method, True)
        llm = make_llm(model_dir, runner="pooling")
        first, again = llm.embed([prompt]), llm.embed([prompt])
        assert first[0].num_cached_tokens == 0
        assert (again[0].num_cached_tokens > 0) == hits, method
        assert llm.engine.describe().kv_cache.enable_prefix_caching == hits
        for output in (first[0], again[0]):
            _assert_close(output.outputs.embedding, reference.embed(prompt, method, True), method)


def test_dimensions_truncate_then_normalize(checkpoint, make_llm, tmp_path, embedder_cache):
    reference = _reference(embedder_cache, checkpoint("llama"), "llama")
    prompt = _prompts(4)[2]
    model_dir = embedding_model(checkpoint("llama"), tmp_path / "model", "last", True, matryoshka=[16, 32])
    llm = make_llm(model_dir, runner="pooling")
    [output] = llm.embed([prompt], PoolingParams(dimensions=16))
    _assert_close(output.outputs.embedding, reference.embed(prompt, "last", True, dimensions=16), "16")
    assert output.outputs.hidden_size == 16
    with pytest.raises(RequestRejected, match="supports only \\[16, 32\\]") as error:
        llm.embed([prompt], PoolingParams(dimensions=8))
    assert error.value.param == "dimensions"
    plain = make_llm(embedding_model(checkpoint("llama"), tmp_path / "plain", "last", True), runner="pooling")
    with pytest.raises(RequestRejected, match="Matryoshka") as error:
        plain.embed([prompt], PoolingParams(dimensions=16))
    assert error.value.param == "dimensions"


def test_each_runner_refuses_the_other_kind(checkpoint, make_llm):
    generate = make_llm(checkpoint("llama"))
    with pytest.raises(RequestRejected, match="--runner pooling"):
        generate.embed(["hello"])
    pooling = make_llm(checkpoint("llama"), runner="pooling")
    with pytest.raises(RequestRejected, match="does not generate"):
        pooling.generate(["hello"], SamplingParams(max_tokens=2))
    assert generate.engine.describe().runner == "generate" and pooling.engine.describe().runner == "pooling"


def test_bad_prompts_are_refused(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama"), runner="pooling", max_model_len=32)
    with pytest.raises(RequestRejected, match="empty"):
        llm.embed([[]])
    with pytest.raises(RequestRejected, match="must be in"):
        llm.embed([[5, 512]])
    with pytest.raises(RequestRejected, match="maximum context length is 32"):
        llm.embed([[5] * 33])
    assert len(llm.embed([[5] * 32])[0].outputs.embedding) == 64  # exactly max_model_len fits


def test_runner_and_convert_resolve_as_vllm():
    assert resolve_runner() == "generate"
    assert resolve_runner("pooling") == "pooling"
    assert resolve_runner(convert="embed") == "pooling"
    with pytest.raises(ValueError, match="needs runner pooling"):
        resolve_runner("generate", "embed")
    with pytest.raises(ValueError, match="runner must be"):
        resolve_runner("draft")


def test_unsupported_pooling_files_are_refused(checkpoint, tmp_path):
    model_dir = embedding_model(checkpoint("llama"), tmp_path / "model", "mean", True)
    config_path = model_dir / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        load_pooling_config(model_dir)
    config_path.write_text(json.dumps({**config, "pooling_mode_cls_token": True}))
    with pytest.raises(ModelLoadError, match="exactly one"):
        load_pooling_config(model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="Dense"):
        load_pooling_config(model_dir)


def test_an_aborted_embedding_frees_its_blocks_and_its_pooled_state(checkpoint, make_llm, tmp_path):
    model_dir = embedding_model(checkpoint("llama"), tmp_path / "model", "mean", True)
    llm = make_llm(model_dir, runner="pooling", max_num_batched_tokens=4)
    engine = llm.engine
    engine.add_request("half", _prompts(5)[3], PoolingParams())
    assert engine.step() == []  # the first chunk: no vector yet
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    engine.abort_request("half")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert llm.embed([[7, 8, 9]])[0].finished  # the next step forgets the aborted request's running sum
    assert engine.runner.pooler._states == {}


def test_a_kv_connector_is_refused_with_the_pooling_runner(checkpoint):
    """Mean and CLS pooling need every prompt position's hidden state, which loaded KV does not give."""
    from pagoda import LLM

    with pytest.raises(ModelLoadError, match="KV connector"):
        LLM(str(checkpoint("llama")), runner="pooling", kv_offloading_size=0.01)
