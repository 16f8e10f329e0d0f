"""What speculation passes around, apart from how drafts are made: a request's `Draft`, the `Proposer` that
makes drafts and the `DraftSource` the scheduler asks each step, and how many drafts a request has room for.

Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagoda.engine.core.request import Request


@dataclass(frozen=True)
class Draft:
    """One request's guesses for a step: a chain (each token guessed after the ones before it) and
    alternatives to the chain's first token, each checked on its own row beside the chain, as a one-token
    branch (a draft model gives them: first_token_candidates)."""

    token_ids: list[int]
    alternatives: list[int] = field(default_factory=list)


class Proposer(Protocol):
    """Guesses the next tokens of requests that may speculate (decoding, in the running batch)."""

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        """A draft for each request, in order: at most num_speculative_tokens tokens each, maybe none."""
        ...

    def finished(self, request: Request) -> None:
        """The request has ended (finished or aborted): whatever is kept for it may go."""
        ...


class DraftSource(Protocol):
    """What the scheduler asks for drafts each step (the Speculator)."""

    def drafts(self, running: Sequence[Request]) -> dict[str, Draft]:
        """Drafts by request id for running requests whose next step is a decode (others: ignored)."""
        ...

    def finished(self, request: Request) -> None:
        """The request has ended: its proposer may drop what it keeps for it."""
        ...


def draft_room(request: Request, num_speculative_tokens: int, num_pending: int = 0) -> int:
    """How many drafts a request may take: the target adds one token of its own to the accepted drafts,
    so drafts stop one short of max_tokens (which the context room caps). num_pending: output tokens
    sampled but not yet appended to the request."""
    room = request.max_output_tokens - request.num_output_tokens - num_pending - 1
    return max(0, min(num_speculative_tokens, room))
