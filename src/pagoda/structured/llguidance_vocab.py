"""llguidance's view of a Hugging Face tokenizer, with the model's non-special added tokens as text.

llguidance reads every entry of a tokenizer's `added_tokens` as a special token: its bytes become a marker
that no grammar text matches. Hermes-style models (Qwen2.5, Hermes, pagoda-demo) add `<tool_call>` and
`</tool_call>` as ordinary (`special: false`) tokens that the model writes as text, and a grammar for a
hermes call must match them as text. Worse, llguidance's mask may allow such a token that its matcher then
refuses. So before llguidance sees a byte-level BPE tokenizer, each non-special added token moves into the
BPE vocabulary under its own id, spelt in the byte-level alphabet: llguidance then reads it as the bytes
the model means. Special tokens (eos, role markers) stay special.

A limit: where a grammar forces literal text, llguidance allows only the tokens of its own tokenization
of that text, which, without the added tokens, spells `<tool_call>` in BPE pieces. The output text is the
same; a forced call is just written in tokens the model did not train on (its own calls, unforced, are
written with the one token).
"""

from __future__ import annotations

import json
from copy import copy
from functools import cache
from typing import Any

import llguidance


def llguidance_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """hf_tokenizer: a fast transformers tokenizer."""
    backend = copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    text_added_tokens_into_vocab(data)
    return llguidance.LLTokenizer(json.dumps(data), n_vocab=n_vocab, eos_token=eos_token_ids)


def text_added_tokens_into_vocab(data: dict[str, Any]) -> None:
    """Move non-special added tokens of a byte-level BPE tokenizer.json (parsed) into its vocabulary."""
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        return  # other tokenizers spell their vocabulary differently: left as llguidance reads them
    vocab: dict[str, int] = model["vocab"]
    kept = []
    for token in data.get("added_tokens") or []:
        spelt = "".join(_byte_alphabet()[byte] for byte in token["content"].encode("utf-8"))
        if token["special"] or vocab.get(spelt, token["id"]) != token["id"]:
            kept.append(token)
        else:
            vocab[spelt] = token["id"]
    data["added_tokens"] = kept


@cache
def _byte_alphabet() -> tuple[str, ...]:
    """The byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other bytes
    for the code points from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return tuple(alphabet[byte] for byte in range(256))
