"""Speculative decoding: a proposer guesses a request's next tokens, and one target step checks them all.

A decoding request with drafts d1..dk computes 1 + k positions in one step: its last sampled token, then
the drafts. At every position the target samples exactly as non-speculative decoding would at that output
position (the drafts before it counting as output), so `accept_drafts` keeps a draft iff the target's own
token there equals it, and ends the run with the target's token at the first mismatch (or, after k
matches, the bonus token after the last draft). The kept tokens are the tokens decoding one at a time
gives, whatever the drafts were: speculation changes how many tokens a step yields, never which.

A draft may also carry alternatives to its first token (`Draft`), each checked on a branch of its own
beside the chain; `accepted_rows` keeps one when the chain's first draft is wrong and it is the target's
token there, and the target's token after it.

That is the rule for greedy rows and for n-gram drafts. A model draft on a sampled row is checked by
rejection sampling instead (engine/sampler.py): the row's token is the draft, kept with probability
min(1, p/q), or a draw from normalise(max(0, p - q)), which differs from the draft; `accept_drafts` then
keeps the same run. The output follows the target's distribution, not the seed's exact tokens.

Pure Python; no torch. The proposer here needs no model: "ngram" (prompt lookup) copies what followed an
earlier occurrence of the request's last few tokens; "suffix" is engine/core/suffix_decoding.py. "draft_model" is
engine/draft_model.py.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.config import SpeculativeConfig
from pagoda.engine.api import SpecDecodeStats
from pagoda.engine.core.drafts import Draft, Proposer, draft_room
from pagoda.engine.core.request import Request
from pagoda.engine.core.suffix_decoding import SuffixProposer
from pagoda.structured.interface import GrammarStateError

_TOKEN = "I"  # array type code of a token id: 4 bytes, unsigned
_TOKEN_BYTES = array(_TOKEN).itemsize


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens, for the largest n in
    [min_n, max_n] that occurs; among occurrences of that n-gram the earliest wins (vLLM's rule: its
    continuation is the longest). An occurrence may overlap the suffix but must end before the last token.
    """
    total = len(tokens)
    if k <= 0:
        return []
    # bytes.find is a C substring search; offsets that are not token-aligned are skipped.
    data = array(_TOKEN, tokens).tobytes()
    search_end = (total - 1) * _TOKEN_BYTES  # an occurrence must be followed by at least one token
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        start = _find_aligned(data, data[(total - n) * _TOKEN_BYTES :], search_end)
        if start is not None:
            return list(tokens[start + n : start + n + k])
    return []


def _find_aligned(data: bytes, pattern: bytes, end: int) -> int | None:
    """The first token index at which `pattern` occurs whole within data[:end], or None."""
    offset = data.find(pattern, 0, end)
    while offset >= 0 and offset % _TOKEN_BYTES:
        offset = data.find(pattern, offset + 1, end)
    return None if offset < 0 else offset // _TOKEN_BYTES


class NgramProposer:
    """Prompt lookup: drafts are what followed the request's last n-gram earlier in its prompt + output."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        return [
            Draft(ngram_lookup(r.all_token_ids, self.min_n, self.max_n, draft_room(r, self.k))) for r in requests
        ]

    def finished(self, request: Request) -> None:
        pass  # nothing is kept


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # resolved by config
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(config)
    if config.method == "draft_model":
        raise ValueError("a draft_model proposer holds a model: the engine loads it (engine/draft_model.py)")
    raise ValueError(f"speculative decoding method {config.method!r} is not supported yet")


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a speculative step yields: the target's samples up to and including the first one that
    differs from its draft (all 1 + len(drafts) when every draft matches). sampled[i] is the target's token
    at the position of drafts[i] (sampled[len(drafts)]: after the last draft)."""
    kept = []
    for draft, token in zip(drafts, sampled):
        kept.append(token)
        if token != draft:
            return kept
    kept.append(sampled[len(drafts)])
    return kept


def accepted_rows(drafts: Sequence[int], alternatives: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The rows whose tokens a speculative step keeps, in order. Rows: the last known token, each draft,
    then each alternative to the first draft (sampled[1 + len(drafts) + j]: the target's token after
    alternative j). The chain's run as `accept_drafts` keeps it; when the chain's first draft is rejected
    but an alternative equals the target's token there, that alternative and the target's token after it."""
    num_kept = len(accept_drafts(drafts, sampled))
    if num_kept == 1 and sampled[0] in alternatives:
        return [0, 1 + len(drafts) + list(alternatives).index(sampled[0])]
    return list(range(num_kept))


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's step: it checked num_draft_tokens drafts and the first num_accepted matched."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self, num_positions: int) -> SpecDecodeStats:
        per_position = self.accepted_per_position + [0] * (num_positions - len(self.accepted_per_position))
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, sum(per_position), tuple(per_position))


class Speculator:
    """Each step's drafts: the proposer's guesses for the running decodes, cut to what may be checked."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer if proposer is not None else build_proposer(config)

    def finished(self, request: Request) -> None:
        self.proposer.finished(request)

    def drafts(self, running: Sequence[Request]) -> dict[str, Draft]:
        """Drafts by request id, for requests whose next step is a decode. None while more requests than
        disable_by_batch_size are running. A constrained request's drafts stop where its grammar refuses;
        alternatives go only with a chain, and never to a constrained request."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return {}
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        result = {}
        for request, proposed in zip(decoding, self.proposer.propose(decoding)):
            tokens = list(proposed.token_ids[: draft_room(request, self.config.num_speculative_tokens)])
            alternatives = [t for t in proposed.alternatives if tokens and t != tokens[0]]
            if tokens and request.grammar is not None:
                tokens, alternatives = tokens[: _num_valid(request, tokens)], []
            if tokens:
                result[request.request_id] = Draft(tokens, alternatives)
        return result


def _num_valid(request: Request, draft: list[int]) -> int:
    """How many of the drafts the request's grammar accepts; 0 when the matcher fails, which the step's
    mask then reports as it would without speculation."""
    assert request.grammar is not None
    try:
        return request.grammar.validate_tokens(draft)
    except GrammarStateError:
        return 0
