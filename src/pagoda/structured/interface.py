"""What the engine needs from a grammar engine, so that another one (xgrammar, ...) can sit beside llguidance.

One backend per tokenizer compiles constraints into grammars (cached); each request gets its own matcher
from its grammar and drives it token by token:

    grammar = backend.compile(params)            # InvalidConstraint if it cannot be compiled
    matcher = grammar.matcher()                  # one per sample
    each step:  matcher.fill_bitmask(bitmask, row)  ->  apply_bitmask(logits, bitmask, rows)  ->  sample
                matcher.accept_tokens([token])      # False: the token is not allowed, state unchanged
                matcher.is_terminated()             # True: finish the request (finish_reason "stop")

Bitmask layout, shared by every backend: int32 [batch, ceil(vocab_size / 32)]; token t is allowed in a
row when bit (t % 32) of word (t // 32) is set. `vocab_size` is the backend's, which covers the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pagoda.structured.params import CacheKey, StructuredOutputsParams

if TYPE_CHECKING:  # bitmasks are tensors, but requests hold matchers in the torch-free engine core
    import torch


class GrammarStateError(RuntimeError):
    """The matcher broke down mid-generation (an internal error or a resource limit in the grammar engine).

    The request cannot continue under its constraint: the caller should fail it, not sample on. From a
    batched call, `rows` names the bitmask rows whose matchers failed (the other rows were written).
    """

    def __init__(self, message: str, rows: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rows = rows


class GrammarMatcher(Protocol):
    """One sample's position in its grammar. Not thread-safe: one thread at a time per matcher."""

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance past `tokens`, all or none: False (state unchanged) if any of them is not allowed."""
        ...

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, would be accepted; the state is unchanged (for drafts)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (at most `num_accepted_tokens`)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (CPU, int32, [batch, words])."""
        ...

    def is_accepting(self) -> bool:
        """The output so far is complete: EOS is allowed now (more tokens may be allowed too)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended: nothing but EOS can follow, so the request should finish with "stop"."""
        ...

    @property
    def num_accepted_tokens(self) -> int:
        """Tokens accepted and not rolled back: the most that `rollback` can undo."""
        ...


class CompiledGrammar(Protocol):
    """A constraint compiled for one tokenizer: immutable, shared by every request that asks for it."""

    @property
    def key(self) -> CacheKey: ...

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        ...


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer and one model vocabulary."""

    @property
    def vocab_size(self) -> int:
        """Tokens covered by a bitmask row: at least the model's vocab size (ids past the tokenizer: never allowed)."""
        ...

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `params`, from the cache when it was compiled before.

        Raises InvalidConstraint (naming `params.param_for(kind)`) when the constraint cannot be compiled.
        """
        ...

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Each (matcher, row): matcher.fill_bitmask(bitmask, row), possibly in parallel. Matchers must be
        this backend's, each at most once."""
        ...
