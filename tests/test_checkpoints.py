"""The tiny seeded checkpoints every other test builds on: they load in transformers, differ by seed,
and their tokenizer is exact (vocab size, round trips, chat template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import tokenizers
import torch
import transformers

from pagoda.testing import ARCHITECTURES, SPECIAL_TOKENS, make_checkpoint, make_tokenizer
from pagoda.testing import checkpoints as checkpoints_module

PROMPT_IDS = [0, 44, 73, 80, 80, 83, 294, 345, 17, 99, 210, 300]
MULTIBYTE_TEXT = "Héllo wörld, café 中文 and 日本語 🙂👍🏽 naïve — 12345.\n  def f(x):\n\treturn x"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        (arch, seed): make_checkpoint(root / f"{arch}-seed{seed}", arch, seed=seed)
        for arch in ARCHITECTURES
        for seed in (0, 1)
    }


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(out_dir)
    return out_dir


def load_model(path: Path, **kwargs) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def greedy_tokens(model: transformers.PreTrainedModel, num_new_tokens: int = 8) -> list[int]:
    ids = torch.tensor([PROMPT_IDS])
    out = model.generate(
        ids, max_new_tokens=num_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2
    )
    return out[0, len(PROMPT_IDS) :].tolist()


@torch.no_grad()
def logits(model: transformers.PreTrainedModel, input_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([input_ids])).logits[0]


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# --- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_loads_and_its_seed_decides_greedy_output(checkpoints, arch):
    seed0, seed1 = load_model(checkpoints[arch, 0]), load_model(checkpoints[arch, 1])
    assert seed0.config.vocab_size == 512
    assert greedy_tokens(seed0) != greedy_tokens(seed1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_is_safetensors_only_with_tokenizer(checkpoints, arch):
    files = {path.name for path in checkpoints[arch, 0].iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".pkl"))]


def test_same_seed_gives_identical_weights(checkpoints, tmp_path):
    again = make_checkpoint(tmp_path, "qwen2", seed=0)
    first = safetensors.torch.load_file(checkpoints["qwen2", 0] / "model.safetensors")
    second = safetensors.torch.load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_every_weight_is_randomised(checkpoints):
    weights = safetensors.torch.load_file(checkpoints["qwen3", 0] / "model.safetensors")
    norm_names = [name for name in weights if "norm" in name]
    assert {"model.layers.0.self_attn.q_norm.weight", "model.norm.weight"} <= set(norm_names)
    for name, tensor in weights.items():
        if name in norm_names:  # 1 + noise, not exactly 1
            assert 0.8 < tensor.mean() < 1.2 and tensor.std() > 0.01, name
        else:
            assert tensor.abs().mean() > 0.05, name
    qwen2 = safetensors.torch.load_file(checkpoints["qwen2", 0] / "model.safetensors")
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].std() > 0.05


@pytest.mark.parametrize(
    ("arch", "model_type", "tied", "expected"),
    [
        ("llama", "llama", False, {"head_dim": 16, "num_key_value_heads": 2}),
        ("llama-mqa", "llama", False, {"num_key_value_heads": 1}),
        ("mistral", "mistral", False, {"sliding_window": 24}),
        ("qwen2", "qwen2", True, {"use_sliding_window": False}),
        (
            "qwen2-swa",
            "qwen2",
            True,
            {"sliding_window": 24, "layer_types": ["full_attention", "sliding_attention"]},
        ),
        ("qwen3", "qwen3", False, {"head_dim": 32}),
    ],
)
def test_config_spells_out_the_architecture(checkpoints, arch, model_type, tied, expected):
    config = read_config(checkpoints[arch, 0])
    assert config["model_type"] == model_type
    assert config["tie_word_embeddings"] is tied
    assert config.items() >= expected.items()
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)


def test_tied_checkpoint_stores_the_embedding_once(checkpoints):
    weights = safetensors.torch.load_file(checkpoints["qwen2", 0] / "model.safetensors")
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights


def test_llama3_rope_scaling_changes_low_frequencies(checkpoints):
    config = read_config(checkpoints["llama3", 0])
    assert config["rope_parameters"]["rope_type"] == "llama3"
    scaled = load_model(checkpoints["llama3", 0]).model.rotary_emb.inv_freq
    default = 10000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    ratio = scaled / default
    # Llama 3's three bands: kept (high frequencies), smoothed, divided by factor 8 (low frequencies).
    assert ratio[0] == pytest.approx(1.0)
    assert all(1 / 8 < r < 1 for r in ratio[1:3])
    assert ratio[3:].tolist() == pytest.approx([1 / 8] * 5)


@pytest.mark.parametrize(
    ("arch", "no_window"),
    [
        ("mistral", {"sliding_window": None}),
        ("qwen2-swa", {"layer_types": ["full_attention", "full_attention"]}),
    ],
)
def test_sliding_window_changes_logits_only_beyond_the_window(checkpoints, arch, no_window):
    windowed = load_model(checkpoints[arch, 0])
    full = load_model(checkpoints[arch, 0], **no_window)
    input_ids = list(range(5, 65))  # 60 tokens, window 24
    windowed_logits, full_logits = logits(windowed, input_ids), logits(full, input_ids)
    torch.testing.assert_close(windowed_logits[:24], full_logits[:24])
    assert not torch.allclose(windowed_logits[30:], full_logits[30:], atol=1e-3)


def test_sharded_checkpoint_writes_an_index(checkpoints, tmp_path):
    sharded = make_checkpoint(tmp_path, "llama", seed=0, max_shard_size="50KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((sharded / shard).exists() for shard in shards)
    assert not (sharded / "model.safetensors").exists()
    torch.testing.assert_close(
        logits(load_model(sharded), PROMPT_IDS), logits(load_model(checkpoints["llama", 0]), PROMPT_IDS)
    )


def test_bf16_checkpoint_is_the_fp32_one_rounded(checkpoints, tmp_path):
    bf16 = make_checkpoint(tmp_path, "llama", seed=0, dtype=torch.bfloat16)
    assert read_config(bf16)["dtype"] == "bfloat16"
    fp32_weights = safetensors.torch.load_file(checkpoints["llama", 0] / "model.safetensors")
    bf16_weights = safetensors.torch.load_file(bf16 / "model.safetensors")
    for name, tensor in bf16_weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32_weights[name].to(torch.bfloat16)), name


def test_overrides_reach_the_config(tmp_path):
    path = make_checkpoint(tmp_path, "llama", rope_theta=500000.0, tie_word_embeddings=True, num_layers=1)
    config = read_config(path)
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 1


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        make_checkpoint(tmp_path, "gpt2")


# --- tokenizer -----------------------------------------------------------------------------------


def test_tokenizer_has_exactly_vocab_size_contiguous_ids(tokenizer_dir):
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert sorted(tokenizer.get_vocab(with_added_tokens=True).values()) == list(range(512))
    assert len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir)) == 512


def test_tokenizer_special_token_ids(tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer("hello")["input_ids"][0] == 0  # BOS prepended, Llama-style
    assert tokenizer("hello", add_special_tokens=False)["input_ids"][0] != 0


def test_tokenizer_round_trips_multibyte_text(tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(MULTIBYTE_TEXT)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == MULTIBYTE_TEXT
    # A 4-byte emoji spans several byte-level tokens, whose prefix alone is not valid UTF-8:
    # what an incremental detokenizer has to hold back.
    emoji_ids = tokenizer("👍🏽", add_special_tokens=False)["input_ids"]
    assert len(emoji_ids) > 1 and tokenizer.decode(emoji_ids[:1]) == "\ufffd"


def test_every_id_decodes(tokenizer_dir):
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert all(
        isinstance(tokenizer.decode([token_id], skip_special_tokens=False), str) for token_id in range(512)
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_tokenizes_like_tokenizer_json(checkpoints, arch):
    # transformers 5 rebuilds qwen2 tokenizers as Qwen2Tokenizer: it must still agree with tokenizer.json.
    path = checkpoints[arch, 0]
    from_transformers = transformers.AutoTokenizer.from_pretrained(path)
    from_json = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(from_transformers) == 512
    assert from_transformers(MULTIBYTE_TEXT)["input_ids"] == from_json.encode(MULTIBYTE_TEXT).ids


def test_tokenizer_is_deterministic(tokenizer_dir, tmp_path):
    checkpoints_module._tokenizer_files.cache_clear()  # retrain rather than reuse the cached files
    make_tokenizer(tmp_path, vocab_size=512, seed=0)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    make_tokenizer(tmp_path / "other", vocab_size=512, seed=1)
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() != (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()


def test_vocab_is_padded_when_training_stops_early(monkeypatch, tmp_path):
    # Too little text for 600 - 261 merges: filler tokens make up the difference.
    monkeypatch.setattr(checkpoints_module, "_english_like_corpus", lambda seed, num_lines: iter(["ab ab"]))
    checkpoints_module._tokenizer_files.cache_clear()
    make_tokenizer(tmp_path, vocab_size=600)
    checkpoints_module._tokenizer_files.cache_clear()
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 600
    assert tokenizer.decode([599], skip_special_tokens=False).startswith("<|filler_")


def test_too_small_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        make_tokenizer(tmp_path, vocab_size=100)


def test_chat_template_renders_chatml(tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n")
    # The template carries BOS itself, so its text is tokenized without adding special tokens.
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [0, 3] and ids.count(0) == 1
