"""Loading a model directory fails early and names the file or field at fault; it never unpickles."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pagoda import LLM
from pagoda.model.loader import load_model_config
from pagoda.model_dir import ModelLoadError


@pytest.fixture
def model_dir(checkpoint, tmp_path) -> Path:
    """A private copy of a tiny Llama checkpoint, free to break."""
    return Path(shutil.copytree(checkpoint("llama"), tmp_path / "model"))


@pytest.fixture
def sharded_dir(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint("llama", max_shard_size="50KB"), tmp_path / "sharded"))


def edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def load(model_dir: Path):
    return LLM(str(model_dir), num_kv_blocks=16, block_size=16)


def test_intact_copy_loads(model_dir):
    llm = load(model_dir)
    assert llm.engine.model_config.architecture == "llama"


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'architectures'.*GPT2LMHeadModel"):
        load(model_dir)


def test_unsupported_rope_type(model_dir):
    def proportional(config):  # a type transformers has (Gemma 4's) and pagoda does not
        key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
        config[key] = {**(config.get(key) or {}), "rope_type": "proportional", "factor": 4.0}

    edit_config(model_dir, proportional)
    with pytest.raises(ModelLoadError, match=r"config\.json.*'rope_(parameters|scaling)'.*'proportional'"):
        load(model_dir)


def test_scaled_rope_without_its_fields_is_refused_naming_them(model_dir):
    edit_config(model_dir, lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'rope_parameters'.*'longrope'.*short_factor"):
        load_model_config(model_dir)


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"])
def test_missing_config_field(model_dir, field):
    edit_config(model_dir, lambda c: c.pop(field))
    with pytest.raises(ModelLoadError, match=rf"config\.json.*'{field}'"):
        load(model_dir)


def test_missing_or_broken_config_file(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json.*not valid JSON"):
        load_model_config(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json.*not found"):
        load_model_config(model_dir)


def test_missing_safetensors_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=rf"{re.escape(str(model_dir))}.*no \*\.safetensors"):
        load(model_dir)


def test_missing_shard(sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded_dir / shard).unlink()
    with pytest.raises(ModelLoadError, match=rf"{re.escape(shard)}.*not found"):
        load(sharded_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(model_dir, damage):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*cannot read safetensors"):
        load(model_dir)


def test_missing_tensor_is_named(model_dir):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj"):
        load(model_dir)


def test_wrong_shape_is_named(model_dir):
    edit_config(model_dir, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape"):
        load(model_dir)


class _Booby:
    """Unpickling this creates a file: proof that a loader unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_pickle_only_directory_is_refused_without_unpickling(model_dir, tmp_path):
    (model_dir / "model.safetensors").unlink()
    tripwire = tmp_path / "unpickled"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _Booby(tripwire)}))
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*pickle"):
        load(model_dir)
    assert not tripwire.exists(), "the loader unpickled a checkpoint"


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load(model_dir)


def test_render_chat_hands_template_variables_to_the_template():
    from pagoda.demo import DEMO_MODEL_DIR
    from pagoda.text.tokenizer import load_tokenizer, render_chat

    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% if enable_thinking %}<think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages) == "hi"
    assert render_chat(tokenizer, messages, template_kwargs={"enable_thinking": True}) == "hi<think>"
