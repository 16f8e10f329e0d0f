"""Structured outputs in the engine: the grammar backend for this engine's tokenizer, and each step's masks.

The backend is built on first use (building llguidance's view of a 32K vocabulary takes ~0.5 s, which an
engine that never sees a constraint should not pay). `compile` may run on any thread (the server
validates on a worker thread); masks are filled on the runner's mask thread while the forward runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from pagoda.structured import CompiledGrammar, GrammarBackend, GrammarMatcher, StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask


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

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """int32 [len(matchers), words]: row i holds the tokens matchers[i] allows next."""
        backend = self._get_backend()
        bitmask = allocate_bitmask(len(matchers), backend.vocab_size)
        backend.fill_bitmasks([(matcher, row) for row, matcher in enumerate(matchers)], bitmask)
        return bitmask

    def _get_backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                from pagoda.structured.llguidance_backend import LLGuidanceBackend

                self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._backend
