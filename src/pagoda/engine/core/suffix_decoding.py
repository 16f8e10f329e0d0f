"""Suffix decoding (vLLM's `"method": "suffix"`): drafts from what followed the request's latest tokens earlier,
in its own prompt and output, or in the outputs of recent requests.

Two kinds of index, each a trie of every substring up to `max_depth` tokens long with how often it occurs:

- a request's own, over its prompt and output, kept while it runs;
- one global index over the outputs of the last `max_cached_requests` requests (running ones included), which is
  how a structure that recurs across answers (JSON keys, a template's phrasing) gets drafted when this request's
  prompt does not hold it. The oldest finished request's output leaves first.

A draft starts at the longest suffix of the request's tokens that the index holds, then follows the likeliest
continuation (a child's count over its siblings' together: of the occurrences that continued, how many went that
way) while the product of those ratios stays at or above `min_token_prob`, for at most `max_spec_factor` times the
matched length (a short match is weak evidence). The depth bounds match and draft together, so shorter matches are
tried too, and each index's best draft, by its expected number of accepted tokens (the sum of the running
products), competes with the other's. A request's suffixes are found from where its last insert (own index) or
read (global index) left off, never by walking from the root each step.

Pure Python; no torch. Drafts never change the output (engine/core/speculative.py checks every one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.config import SpeculativeConfig
from pagoda.engine.core.drafts import Draft, draft_room
from pagoda.engine.core.request import Request


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class _Cursor:
    """Where a sequence's inserts continue: the nodes of its suffixes shorter than the depth, with their depths."""

    active: list[tuple[_Node, int]] = field(default_factory=list)
    length: int = 0  # tokens inserted


class SuffixIndex:
    """Every substring of the sequences added, up to max_depth tokens, with its number of occurrences."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, cursor: _Cursor, tokens: Sequence[int]) -> None:
        """Appends tokens to the sequence `cursor` follows: each suffix ending at a new token counts once more."""
        for token in tokens:
            following = []
            for node, depth in [*cursor.active, (self.root, 0)]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                if depth + 1 < self.max_depth:
                    following.append((child, depth + 1))
            cursor.active = following
            cursor.length += 1

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes a sequence added before back out; substrings it alone held are dropped."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def follow(self, cursor: _Cursor, tokens: Sequence[int]) -> None:
        """Moves a reading cursor along tokens without adding them: its nodes stay those of the suffixes of what
        it has read that the index holds (below the depth, so that each may continue)."""
        for token in tokens:
            following = []
            for node, depth in [*cursor.active, (self.root, 0)]:
                child = node.children.get(token)
                if child is not None and depth + 1 < self.max_depth:
                    following.append((child, depth + 1))
            cursor.active = following
            cursor.length += 1

    def read(self, tokens: Sequence[int]) -> _Cursor:
        """A reading cursor over the last max_depth tokens of a sequence."""
        cursor = _Cursor()
        self.follow(cursor, tokens[max(0, len(tokens) - self.max_depth) :])
        cursor.length = len(tokens)
        return cursor

    def draft(self, matches: Sequence[tuple[_Node, int]], max_tokens: int, max_spec_factor: float,
              min_token_prob: float) -> tuple[list[int], float]:
        """The best draft from the matched suffixes (node, length), and its expected number of accepted tokens.
        A longer match is better evidence, but the depth bounds match and draft together: each is tried, the
        longest first, until no shorter one could expect more."""
        best: tuple[list[int], float] = ([], 0.0)
        for node, length in sorted(matches, key=lambda match: -match[1]):
            limit = min(max_tokens, int(max_spec_factor * length), self.max_depth - length)
            if limit <= best[1]:  # a draft cannot expect more accepted tokens than its length
                break
            tokens: list[int] = []
            score, probability = 0.0, 1.0
            while len(tokens) < limit and node.children:
                token, child = max(node.children.items(), key=lambda item: item[1].count)
                # Among the occurrences that continued: the one being drafted for has not, yet.
                probability *= child.count / sum(c.count for c in node.children.values())
                if probability < min_token_prob:
                    break
                tokens.append(token)
                score += probability
                node = child
            if score > best[1]:
                best = (tokens, score)
        return best


@dataclass
class _RequestState:
    own: SuffixIndex  # over the request's prompt and output
    inserted: _Cursor = field(default_factory=_Cursor)  # where inserts into `own` continue
    output: _Cursor = field(default_factory=_Cursor)  # where inserts of its output into the global index continue
    output_tokens: list[int] = field(default_factory=list)
    reading: _Cursor | None = None  # its matches in the global index
    reading_version: int = -1  # the global index's version `reading` was read in


class SuffixProposer:
    """Drafts for each request from its own index and the global one, whichever expects more."""

    def __init__(self, config: SpeculativeConfig) -> None:
        options = config.suffix_options()
        self.k = config.num_speculative_tokens
        self.max_depth = options.max_tree_depth
        self.max_cached = options.max_cached_requests
        self.max_spec_factor = options.max_spec_factor
        self.min_token_prob = options.min_token_prob
        self.requests: dict[str, _RequestState] = {}  # running requests that have asked for drafts
        self.shared = SuffixIndex(self.max_depth)
        # The outputs in the global index, oldest first: running requests' (still growing) and finished ones'.
        self.outputs: OrderedDict[str, list[int]] = OrderedDict()
        self.finished_outputs: set[str] = set()
        self.version = 0  # counts removals from the global index: reading cursors read before one are stale

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        return [Draft(self._draft(request)) for request in requests]

    def finished(self, request: Request) -> None:
        """The request ended: its own index goes; its output stays in the global one, first to leave."""
        self.requests.pop(request.request_id, None)
        if request.request_id in self.outputs:
            self.finished_outputs.add(request.request_id)
            self._evict()

    def _draft(self, request: Request) -> list[int]:
        tokens = request.all_token_ids
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests[request.request_id] = _RequestState(SuffixIndex(self.max_depth))
        # Its own index holds every token so far; the suffixes' nodes are where its inserts continue.
        state.own.extend(state.inserted, tokens[state.inserted.length :])
        room = draft_room(request, self.k)
        best, best_score = state.own.draft(state.inserted.active, room, self.max_spec_factor, self.min_token_prob)
        if self.max_cached == 0:
            return best
        if request.request_id not in self.outputs:
            self.outputs[request.request_id] = state.output_tokens
            self._evict()
        new_output = tokens[request.num_prompt_tokens + state.output.length :]
        self.shared.extend(state.output, new_output)
        state.output_tokens.extend(new_output)
        if state.reading is None or state.reading_version != self.version:
            state.reading, state.reading_version = self.shared.read(tokens), self.version
        else:
            self.shared.follow(state.reading, tokens[state.reading.length :])
        shared, score = self.shared.draft(state.reading.active, room, self.max_spec_factor, self.min_token_prob)
        return shared if score > best_score else best

    def _evict(self) -> None:
        """Drops the oldest finished outputs while more than max_cached requests are held."""
        while len(self.outputs) > self.max_cached:
            oldest = next((rid for rid in self.outputs if rid in self.finished_outputs), None)
            if oldest is None:  # every output held is still growing: they stay until one finishes
                return
            tokens = self.outputs.pop(oldest)
            self.finished_outputs.discard(oldest)
            self.shared.remove(tokens)
            self.version += 1
