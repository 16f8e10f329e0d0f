"""Tiny Hugging Face checkpoints with seeded random weights, and the tokenizer they ship with.

Tests never download models: they build them here, in a temporary directory, from `transformers`' own
config and model classes, so the checkpoint on disk is exactly what `transformers` would write for a
real model of that architecture (config.json, *.safetensors, tokenizer.json, tokenizer_config.json).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pagoda.testing.architecture_specs import ARCH_SPECS, ARCHITECTURES

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "make_checkpoint",
    "make_tokenizer",
]

# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

# Trained first, so they take ids 0..4: <s>=0, </s>=1, <pad>=2, <|im_start|>=3, <|im_end|>=4.
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD, IM_START, IM_END = SPECIAL_TOKENS
_BYTE_ALPHABET_SIZE = 256
# Qwen2's split (GPT-4-like; one digit per token), from transformers' tokenization_qwen2.py.
_PRETOKENIZE_REGEX = "|".join(
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)
_MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + _BYTE_ALPHABET_SIZE

# ChatML, as Qwen writes it, with a leading BOS as Llama 3 does: a chat prompt must therefore be
# tokenized with add_special_tokens=False, or it starts with two BOS tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# fmt: off
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "ch", "sh", "th", "st", "tr", "pl", "gr", "br")
_VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "ou", "io", "é", "è", "ü", "ö")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "ck", "nd", "ng", "st")
# Multi-byte UTF-8 (2, 3 and 4 bytes, and a grapheme made of two code points) so that byte-level
# tokens which split a character exist, and incremental detokenization has something to get wrong.
_EXOTIC = ("中文", "日本語", "한국어", "🙂", "🚀", "👍🏽", "naïve", "Ελληνικά", "Привет", "→", "€", "—",
           "café")
# fmt: on
_PUNCTUATION = (".", ".", ".", "?", "!", ":", ";")
_CODE = ("def f(x):\n    return x + 1\n", "for i in range(10):\n\tprint(i)\n", '{"key": [1, 2, 3]}\n')


def _random_word(rng: random.Random) -> str:
    syllables = rng.randint(1, 4)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _english_like_corpus(seed: int, num_lines: int) -> Iterator[str]:
    """Sentences over a Zipf-distributed lexicon, so that BPE learns whole frequent words, as on English."""
    rng = random.Random(seed)
    lexicon = list(dict.fromkeys(_random_word(rng) for _ in range(2 * num_lines)))
    zipf_cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))

    def word(position: int) -> str:
        roll = rng.random()
        if roll < 0.05:
            text = str(rng.randint(0, 10 ** rng.randint(1, 5)))
        elif roll < 0.08:
            text = rng.choice(_EXOTIC)
        else:
            text = rng.choices(lexicon, cum_weights=zipf_cum_weights)[0]
        text = text.capitalize() if position == 0 else text
        return text + ("," if rng.random() < 0.08 else "")

    def sentence() -> str:
        return " ".join(word(i) for i in range(rng.randint(4, 15))) + rng.choice(_PUNCTUATION)

    for _ in range(num_lines):
        line = " ".join(sentence() for _ in range(rng.randint(1, 4)))
        yield line + "\n" + (rng.choice(_CODE) if rng.random() < 0.02 else "")


def _train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Qwen2's pipeline, exactly: transformers 5 rebuilds any qwen2 checkpoint's tokenizer as
    # Qwen2Tokenizer (from vocab + merges) whatever tokenizer.json says, and the two must agree.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, whether or not the corpus uses them: any text (and any id) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per vocab entry is enough text for the trainer to reach 32000 tokens.
    tokenizer.train_from_iterator(_english_like_corpus(seed, num_lines=max(vocab_size, 512)), trainer=trainer)

    # The trainer stops early when it runs out of pairs to merge; fill up to exactly vocab_size, so a
    # model with this vocab never emits an id the tokenizer cannot decode.
    num_missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(f"<|filler_{i}|>", special=True) for i in range(num_missing)])

    # Llama-style: plain encode() prepends BOS. Written as transformers rebuilds it from add_bos_token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        # "PreTrainedTokenizerFast" makes transformers (4.x and 5.x) take tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


@functools.lru_cache(maxsize=8)
def _tokenizer_files(vocab_size: int, seed: int) -> tuple[tuple[str, str], ...]:
    """The tokenizer's files as (name, text); cached because training costs ~0.1 s (512) to ~4 s (32000)."""
    tokenizer = _train_tokenizer(vocab_size, seed)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return (
        ("tokenizer.json", tokenizer.to_str(pretty=True)),
        ("tokenizer_config.json", json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"),
    )


def make_tokenizer(out_dir: Path, vocab_size: int = 512, seed: int = 0) -> None:
    """Write a byte-level BPE tokenizer of exactly `vocab_size` tokens, trained on seeded fake English.

    Loadable with `transformers.AutoTokenizer.from_pretrained(out_dir)` and `tokenizers.Tokenizer.from_file`.
    Same arguments, same bytes. Ids: <s>=0, </s>=1, <pad>=2, <|im_start|>=3, <|im_end|>=4.
    """
    if vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {_MIN_VOCAB_SIZE} (special tokens + 256 bytes)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in _tokenizer_files(vocab_size, seed):
        (out_dir / name).write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------

_NORM_NOISE_STD = 0.05


def _build_config(
    arch: str, fields: dict[str, Any], overrides: dict[str, Any]
) -> transformers.PretrainedConfig:
    config_cls_name, _, arch_fields = ARCH_SPECS[arch]
    # deepcopy: the config class fills in rope_parameters in place, which must not leak into ARCH_SPECS.
    fields = {**fields, **copy.deepcopy(arch_fields), **overrides}
    rope = fields.get("rope_parameters", {})
    if "full_attention" in rope:  # per layer type (Gemma 3): the model's rope_theta is the global layers'
        rope["full_attention"].setdefault("rope_theta", fields.pop("rope_theta"))
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta"), **rope}
    if arch == "qwen2-swa":  # the first half of the layers full, the rest sliding
        fields.setdefault("max_window_layers", fields["num_hidden_layers"] // 2)
    config_cls: type[transformers.PreTrainedConfig] = getattr(transformers, config_cls_name)
    return config_cls(**fields)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Every parameter seeded normal(0, init_std), norm scales 1 + noise: large enough that greedy
    choices are decisive rather than near-ties between two implementations' rounding."""
    generator = torch.Generator().manual_seed(seed)
    # named_parameters() yields a tied tensor once; its order is the modules' construction order.
    for name, param in model.named_parameters():
        # Drawn in fp32 whatever the model dtype, so a bf16 checkpoint is the fp32 one rounded.
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        is_norm_scale = param.ndim == 1 and not name.endswith("bias")
        param.copy_(1.0 + _NORM_NOISE_STD * noise if is_norm_scale else init_std * noise)


def make_checkpoint(
    out_dir: Path,
    arch: str,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    init_std: float = 0.2,
    rope_theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    tokenizer_seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny HF checkpoint of `arch` (one of ARCHITECTURES) with seeded random weights to out_dir.

    The directory holds config.json, generation_config.json, model.safetensors (or shards plus
    model.safetensors.index.json when `max_shard_size` is given, e.g. "50KB") and the tokenizer of
    `make_tokenizer(out_dir, vocab_size, tokenizer_seed)`. `config_overrides` go to the config class
    last (e.g. tie_word_embeddings=True). Returns out_dir.

    init_std is 0.2 rather than HF's 0.02 (or 0.1): at 0.1 the tied-embedding models (llama3, qwen2)
    fall into repeating one token within ~10 greedy steps, which would hide position and window bugs.
    """
    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    out_dir = Path(out_dir)
    make_tokenizer(out_dir, vocab_size=vocab_size, seed=tokenizer_seed)
    fields = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        # transformers 5 keeps rope_theta inside rope_parameters; _build_config moves it there.
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-6,
        "initializer_range": init_std,
        "bos_token_id": _token_id(BOS),
        "eos_token_id": _token_id(EOS),
        "pad_token_id": _token_id(PAD),
    }
    config = _build_config(arch, fields, config_overrides)
    model_cls = getattr(transformers, ARCH_SPECS[arch][1])
    model = model_cls._from_config(config, dtype=dtype)
    _init_weights(model, seed, init_std)
    model.generation_config = _generation_config()
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    with _no_progress_bars():
        model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    # transformers draws a "Writing model shards" bar per save: noise in test logs.
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # (transformers leaves it unannotated)
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _generation_config() -> transformers.GenerationConfig:
    # Chat turns end in <|im_end|>, plain text in </s>: stop on either, as Qwen and Llama 3 instruct do.
    return transformers.GenerationConfig(  # type: ignore[no-untyped-call]  # (its __init__ takes **kwargs only)
        bos_token_id=_token_id(BOS),
        eos_token_id=[_token_id(EOS), _token_id(IM_END)],
        pad_token_id=_token_id(PAD),
        do_sample=False,
    )


def _token_id(special_token: str) -> int:
    # The trainer gives special tokens the first ids, in order (checked by tests/test_checkpoints.py).
    return SPECIAL_TOKENS.index(special_token)
