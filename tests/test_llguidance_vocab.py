"""A model's non-special added tokens (hermes `<tool_call>`) are text to the grammar engine: a grammar that
writes `<tool_call>` accepts the one token the model writes for it, and the mask never allows a token the
matcher then refuses. Special tokens stay special."""

from __future__ import annotations

import torch

from pagoda.demo import DEMO_MODEL_DIR
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.bitmask import bitmask_width
from pagoda.structured.llguidance_backend import LLGuidanceBackend
from pagoda.text.tokenizer import load_tokenizer


def _backend() -> tuple[object, LLGuidanceBackend]:
    tokenizer = load_tokenizer(str(DEMO_MODEL_DIR))
    return tokenizer, LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _allowed(matcher, vocab_size: int) -> list[int]:
    mask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    return [i for i in range(vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]


def test_added_text_tokens_are_bytes_and_special_tokens_stay_special():
    tokenizer, backend = _backend()
    call = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert backend.llg_tokenizer.decode_bytes([call]) == b"<tool_call>"
    assert not backend.llg_tokenizer.is_special_token(call)
    assert backend.llg_tokenizer.is_special_token(tokenizer.eos_token_id)


def test_a_grammar_writing_the_marker_takes_the_models_token_and_its_mask_agrees():
    tokenizer, backend = _backend()
    call, newline = tokenizer.convert_tokens_to_ids("<tool_call>"), tokenizer.encode("\n", add_special_tokens=False)
    grammar = backend.compile(StructuredOutputsParams(regex=r"<tool_call>\n(ab|cd)"))
    assert grammar.matcher().accept_tokens([call, *newline])  # the model's own spelling of the marker
    matcher = grammar.matcher()
    for _ in range(12):  # walk the grammar on its own mask: every allowed token is accepted
        allowed = _allowed(matcher, backend.vocab_size)
        assert allowed
        if matcher.is_terminated():
            break
        assert matcher.accept_tokens([allowed[0]]), allowed[0]
    assert matcher.is_accepting()
