"""The incremental text a sample's tokens decode to."""

from __future__ import annotations

from typing import Protocol

from pagoda.text.tokenizer import Tokenizer


class _IdsDecoder(Protocol):
    """A fast tokenizer's Rust backend (`tokenizers.Tokenizer`): decoding without transformers' wrapper."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text, a delta at a time.

    Decodes a short window twice (up to the previous read point, and up to now) and emits the
    difference. While the tail is an incomplete UTF-8 character ("\ufffd"), the text before it is
    emitted and the window is not advanced, so the character comes out whole once complete. The
    deltas concatenate to the text of decoding all tokens at once (tested for multi-byte characters).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        # The Rust tokenizer directly: transformers' decode wrapper costs more than the decoding itself.
        self._decode_ids: _IdsDecoder | None = getattr(tokenizer, "backend_tokenizer", None)
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted_past_read = 0  # characters already emitted beyond the read point's text

    def _decode(self, ids: list[int]) -> str:
        if self._decode_ids is not None:
            return self._decode_ids.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        complete = not new_text.endswith("\ufffd")
        stable = new_text if complete else new_text.rstrip("\ufffd")
        delta = stable[len(prefix_text) + self.emitted_past_read :]
        if complete and len(new_text) > len(prefix_text):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.emitted_past_read = 0
        else:
            self.emitted_past_read += len(delta)
        return delta


__all__ = ["IncrementalDetokenizer", "Tokenizer"]
