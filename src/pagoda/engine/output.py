"""Turning sampled tokens into what users see: incremental text, stop strings, each sample's CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagoda.engine.api import CompletionOutput
from pagoda.engine.request import Request


class Tokenizer(Protocol):
    """What the runtime and the server use of a Hugging Face tokenizer."""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str: ...

    def __len__(self) -> int: ...  # the vocabulary's size, added tokens included


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


@dataclass
class SequenceText:
    """The text side of one Request: detokenizer, stop strings, and what may be shown so far."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    # Stop strings may straddle tokens: this many trailing characters are held back until it is
    # clear they do not begin a stop string.
    holdback: int = field(init=False)

    def __post_init__(self) -> None:
        stops = self.request.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def add_token(self, token_id: int) -> str | None:
        """Appends the token's text; returns the stop string if one now appears in the text."""
        if token_id in self.request.eos_token_ids and not self.request.params.ignore_eos:
            return None  # eos ends the request but is not text (vLLM: excluded from output text)
        previous_length = len(self.text)
        self.text += self.detokenizer.add(token_id)
        stops = self.request.params.stop
        if not stops or len(self.text) == previous_length:
            return None
        search_from = max(0, previous_length - self.holdback)
        found = [(self.text.find(s, search_from), s) for s in stops]
        found = [(index, s) for index, s in found if index >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index]
        return stop

    def visible_text(self) -> str:
        if self.request.is_finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def completion(self) -> CompletionOutput:
        request = self.request
        logprobs = list(request.output_logprobs) if request.params.logprobs is not None else None
        finish = request.finish_reason.value if request.finish_reason is not None else None
        cumulative = None
        if logprobs is not None:
            cumulative = sum(lp[t] for lp, t in zip(logprobs, request.output_token_ids))
        return CompletionOutput(
            index=request.sample_index,
            text=self.visible_text(),
            token_ids=list(request.output_token_ids),
            finish_reason=finish,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
            timeline=request.timeline() if request.is_finished else None,
        )


__all__ = ["IncrementalDetokenizer", "SequenceText", "Tokenizer"]
