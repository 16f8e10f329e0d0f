"""Structured outputs in the engine: the grammar backend for this engine's tokenizer, and each step's masks.

The backend is built on first use (building llguidance's view of a 32K vocabulary takes ~0.5 s, which an
engine that never sees a constraint should not pay). `compile` may run on any thread (the server
validates on a worker thread); masks are filled on the runner's mask thread while the forward runs.
A speculating request needs one mask per position: its matcher walks along the drafts (accept, fill) and
is rolled back to where it began, so that only tokens the engine keeps ever advance it for good.

A matcher that fails to fill its rows, or whose mask allows no token at all, is that request's fault: the
fill reports it by matcher and writes every other row, so that the engine fails that request alone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.structured import StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask
from pagoda.structured.interface import CompiledGrammar, GrammarBackend, GrammarMatcher, GrammarStateError
from pagoda.structured.limits import GrammarLimits


@dataclass
class GrammarMasks:
    """int32 [rows, words] masks, and the matchers that failed (by index in the fill's list), whose rows
    hold nothing meaningful."""

    bitmask: torch.Tensor
    failures: dict[int, Exception] = field(default_factory=dict)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._limits = limits
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `params`, cached by constraint. Raises InvalidConstraint naming the field."""
        return self._get_backend().compile(params)

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]] | None = None
    ) -> GrammarMasks:
        """For each matcher in order, 1 + len(its drafts) rows: the tokens it allows next after 0, 1, ... of
        its drafts (which it must accept: validated). Without drafts: one row each."""
        drafts = drafts if drafts is not None else [()] * len(matchers)
        backend = self._get_backend()
        masks = GrammarMasks(allocate_bitmask(sum(1 + len(draft) for draft in drafts), backend.vocab_size))
        single_rows: list[tuple[GrammarMatcher, int]] = []
        first_rows, row = [], 0
        for index, (matcher, draft) in enumerate(zip(matchers, drafts)):
            first_rows.append(row)
            if draft:
                try:
                    _fill_along_drafts(matcher, draft, masks.bitmask, row)
                except Exception as error:  # a failing matcher is its own request's fault
                    masks.failures[index] = error
            else:
                single_rows.append((matcher, row))
            row += 1 + len(draft)
        index_of_row = {first: index for index, first in enumerate(first_rows)}
        try:
            backend.fill_bitmasks(single_rows, masks.bitmask)
        except Exception as error:
            if isinstance(error, GrammarStateError) and error.rows:
                for failed_row in error.rows:  # the other rows are written
                    masks.failures[index_of_row[failed_row]] = GrammarStateError(str(error))
                return self._check_rows(masks, first_rows, drafts)
            # The batch failed without naming a row: fill the rows one by one to find whose fault it is.
            for matcher, single_row in single_rows:
                try:
                    matcher.fill_bitmask(masks.bitmask, single_row)
                except Exception as error:
                    masks.failures[index_of_row[single_row]] = error
        return self._check_rows(masks, first_rows, drafts)

    @staticmethod
    def _check_rows(masks: GrammarMasks, first_rows: list[int], drafts: Sequence[Sequence[int]]) -> GrammarMasks:
        """A row that allows no token (not even EOS) leaves nothing to sample: its matcher has failed. A failed
        matcher's rows then allow every token, so that the sampler never sees a row with nothing to draw."""
        for index, first in enumerate(first_rows):
            end = first + 1 + len(drafts[index])
            if index not in masks.failures and not bool(masks.bitmask[first:end].any(dim=1).all()):
                masks.failures[index] = GrammarStateError("the grammar allows no token here")
            if index in masks.failures:
                masks.bitmask[first:end] = -1
        return masks

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                from pagoda.structured.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size, self._eos_token_ids,
                                                  limits=self._limits)
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
