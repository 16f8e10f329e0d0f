"""Adapters that cannot be served exactly are refused at submission, naming the adapter and what is wrong: shapes
that do not fit the base model, a rank over --max-lora-rank, pickle-only files, unknown target modules, and the
PEFT features pagoda does not compute (DoRA, modules_to_save, embedding or LM-head targets, biases). Never a
wrong output."""

from __future__ import annotations

import json
import shutil

import pytest
from lora_fixtures import make_adapter

from pagoda import LoRARequest, SamplingParams
from pagoda.engine.api import RequestRejected

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_adapter(base, tmp_path_factory.mktemp("good"), r=8, alpha=16, targets=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def llm(base):
    from pagoda import LLM

    return LLM(str(base), enable_lora=True, num_kv_blocks=64, block_size=4)


def refused(llm, path, match: str) -> None:
    request = LoRARequest("bad", 1, str(path))
    with pytest.raises(RequestRejected, match=match):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=request)
    assert not llm.engine.has_unfinished_requests()


def edited(source, target, **fields):
    """A copy of the adapter at `source` whose adapter_config.json has `fields` set."""
    shutil.copytree(source, target)
    config_path = target / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(fields)
    config_path.write_text(json.dumps(config))
    return target


def test_a_good_adapter_runs(llm, good):
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False,
                            lora_request=LoRARequest("good", 1, str(good)))
    assert len(output.outputs[0].token_ids) == 2


def test_shapes_that_do_not_fit_the_base_model(llm, checkpoint, tmp_path):
    other = checkpoint("llama", hidden_size=32, intermediate_size=64)
    adapter = make_adapter(other, tmp_path / "a", r=4, alpha=8, targets=["q_proj", "down_proj"])
    refused(llm, adapter, r"'bad'|adapter '.*': layer 0 down_proj has lora_A \(4, 64\).*does not fit this model")


def test_more_layers_than_the_base_model(llm, checkpoint, tmp_path):
    deeper = checkpoint("llama", num_layers=3)
    adapter = make_adapter(deeper, tmp_path / "a", r=4, alpha=8, targets=["q_proj"])
    refused(llm, adapter, "is for layer 2; the base model has 2 layers")


def test_rank_over_max_lora_rank(llm, base, tmp_path):
    adapter = make_adapter(base, tmp_path / "a", r=32, alpha=32, targets=["q_proj"])
    refused(llm, adapter, "rank 32 is over --max-lora-rank 16")


def test_a_higher_max_lora_rank_takes_it(base, tmp_path, make_llm):
    adapter = make_adapter(base, tmp_path / "a", r=32, alpha=32, targets=["q_proj"])
    llm = make_llm(base, enable_lora=True, max_lora_rank=32)
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False,
                 lora_request=LoRARequest("wide", 1, str(adapter)))


def test_pickle_only_adapter(llm, base, tmp_path):
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.save_pretrained(str(tmp_path / "a"), safe_serialization=False)
    assert (tmp_path / "a" / "adapter_model.bin").is_file()
    refused(llm, tmp_path / "a", r"adapter_model.safetensors is missing \(found adapter_model.bin: pickle files")


def test_missing_directory_and_config(llm, good, tmp_path):
    refused(llm, tmp_path / "nowhere", "not a directory")
    (tmp_path / "empty").mkdir()
    refused(llm, tmp_path / "empty", "adapter_config.json is missing")


def test_unknown_target_module(llm, good, tmp_path):
    refused(llm, edited(good, tmp_path / "a", target_modules=["q_proj", "fc1"]), "unknown target module 'fc1'")


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head"]])
def test_embedding_and_lm_head_targets(llm, base, tmp_path, targets):
    adapter = make_adapter(base, tmp_path / "a", r=4, alpha=8, targets=["q_proj", *targets])
    refused(llm, adapter, f"target module '{targets[0]}' is not supported")


def test_tensors_beyond_the_config_are_refused_by_what_they_are(llm, base, tmp_path):
    """A target named by regex in the config is checked on the tensors: an LM-head adapter is still refused."""
    adapter = make_adapter(base, tmp_path / "a", r=4, alpha=8, targets=["q_proj", "lm_head"])
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = ".*(q_proj|lm_head)"
    config_path.write_text(json.dumps(config))
    refused(llm, adapter, r"tensor 'base_model.model.lm_head.*' is not supported \(an embedding or LM-head adapter\)")


@pytest.mark.parametrize(("fields", "match"), [
    ({"use_dora": True}, r"DoRA \(use_dora\) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save .* is not supported"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"bias": "lora_only"}, "bias 'lora_only' is not supported"),
    ({"lora_bias": True}, "bias on lora_B"),
    ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_unsupported_features(llm, good, tmp_path, fields, match):
    refused(llm, edited(good, tmp_path / "a", **fields), match)


def test_dora_made_by_peft(llm, base, tmp_path):
    adapter = make_adapter(base, tmp_path / "a", r=4, alpha=8, targets=["q_proj"], use_dora=True)
    refused(llm, adapter, "DoRA")


def test_lora_request_without_enable_lora(base, good, make_llm):
    llm = make_llm(base)
    with pytest.raises(RequestRejected, match="LoRA is not enabled"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("good", 1, str(good)))


def test_lora_request_fields_and_one_per_prompt(llm, good):
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, str(good))
    with pytest.raises(ValueError, match="one LoRARequest, or one per prompt"):
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=[LoRARequest("good", 1, str(good))])


def test_pipeline_stages_refuse_lora(base):
    """Tensor parallelism serves adapters (test_lora_tensor_parallel.py); pipeline stages do not yet."""
    from pagoda import LLM
    from pagoda.model_dir import ModelLoadError

    with pytest.raises(ModelLoadError, match="--enable-lora .*with pipeline stages"):
        LLM(str(base), enable_lora=True, pipeline_parallel_size=2, num_kv_blocks=16)
