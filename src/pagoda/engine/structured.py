"""Structured outputs in the engine: the grammar backend for this engine's tokenizer, and each step's masks.

The backend is built on first use (building llguidance's view of a 32K vocabulary takes ~0.5 s, which an
engine that never sees a constraint should not pay). `compile` may run on any thread (the server
validates on a worker thread); masks are filled on the runner's mask thread while the forward runs.
A speculating request needs one mask per position: its matcher walks along the drafts (accept, fill) and
is rolled back to where it began, so that only tokens the engine keeps ever advance it for good.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from pagoda.structured import StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask
from pagoda.structured.interface import CompiledGrammar, GrammarBackend, GrammarMatcher, GrammarStateError


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `params`, cached by constraint. Raises InvalidConstraint naming the field."""
        return self._get_backend().compile(params)

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """int32 [rows, words]: for each matcher in order, 1 + len(its drafts) rows, the tokens it allows next
        after 0, 1, ... of its drafts (which it must accept: validated). Without drafts: one row each."""
        drafts = drafts if drafts is not None else [()] * len(matchers)
        backend = self._get_backend()
        bitmask = allocate_bitmask(sum(1 + len(draft) for draft in drafts), backend.vocab_size)
        single_rows, row = [], 0
        for matcher, draft in zip(matchers, drafts):
            if draft:
                _fill_along_drafts(matcher, draft, bitmask, row)
            else:
                single_rows.append((matcher, row))
            row += 1 + len(draft)
        backend.fill_bitmasks(single_rows, bitmask)
        return bitmask

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                from pagoda.structured.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._backend


def _fill_along_drafts(matcher: GrammarMatcher, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
    """Rows first_row + i: the mask after drafts[:i]. The matcher ends where it began, even on error."""
    accepted = 0
    try:
        matcher.fill_bitmask(bitmask, first_row)
        for token_id in drafts:
            if not matcher.accept_tokens([token_id]):
                raise GrammarStateError(f"the grammar refused draft token {token_id} that it had validated",
                                        rows=(first_row + accepted + 1,))
            accepted += 1
            matcher.fill_bitmask(bitmask, first_row + accepted)
    finally:
        matcher.rollback(accepted)
