"""Draft-model speculation: a smaller or cheaper model that shares the target's vocabulary proposes each
speculating request's next k tokens, one batched draft forward per token.

KV: the draft has its own KV tensors, laid out like the target's: slot s holds the draft's K/V of the token
whose target K/V is at slot s. After every target step, `follow` runs the draft over the tokens the step
kept (prompt chunks, decodes and accepted drafts, at the target's slots) and the newest token, so the
draft's cache is valid wherever the target's is, whatever happens to the blocks afterwards: a rollback of
rejected drafts, a preemption, a prefix-cache hit on a block another request computed. No per-request KV
state. The same forward's logits at each request's newest token give its first draft for the next step,
so a step of k drafts costs k draft forwards: this one and k - 1 one-token proposals.

Proposing writes K/V only past a request's computed tokens: into its own blocks where it has them (not
yet full, so never shared or cached, and rewritten by the next `follow` before anything reads them) and,
past its last block, into scratch blocks after the pool's end, which only proposals use.

Sampled requests keep q, the distribution each draft was drawn from, for the target's rejection sampling
(`sampler.Proposal`). Constrained requests draft under their grammar's mask (the matcher advances along
the drafts and is rolled back), so every draft is valid before verification and q is the masked one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.config import ModelConfig, SpeculativeConfig
from pagoda.engine.core.drafts import Draft, draft_room
from pagoda.engine.core.request import Request
from pagoda.engine.core.scheduler import ScheduledRequest
from pagoda.engine.grammar_masks import StructuredOutputs
from pagoda.engine.sampler import Proposal, SampleRow, build_sampling_metadata, sample_draft
from pagoda.model.attention import QueryLayout, build_metadata
from pagoda.model.kv_cache import LayerKV
from pagoda.model.llama import LlamaModel
from pagoda.model.loader import TORCH_DTYPES, load_model, load_model_config
from pagoda.model_dir import ModelLoadError
from pagoda.sampling import GREEDY_EPS
from pagoda.structured.interface import GrammarMatcher, GrammarStateError
from pagoda.text.tokenizer import has_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class DraftMismatch(ModelLoadError):
    """The draft model cannot draft for this target (another vocabulary, too short a context)."""


def check_draft_config(draft: ModelConfig, target: ModelConfig, path: str) -> None:
    """A draft must share the target's vocabulary: its token ids are checked as the target's."""
    if draft.vocab_size != target.vocab_size:
        raise DraftMismatch(
            f"draft model {path}: vocab size {draft.vocab_size}, the target's is {target.vocab_size}; "
            "a draft model must share the target's vocabulary"
        )


def check_draft_tokenizer(draft_tokenizer: Any | None, target_tokenizer: Any, path: str) -> None:
    """Where both models ship a tokenizer, the two must map the same strings to the same ids."""
    if draft_tokenizer is None:
        return
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
        raise DraftMismatch(
            f"draft model {path}: its tokenizer's vocabulary differs from the target's (e.g. {differing}); "
            "a draft model must share the target's vocabulary"
        )


def load_draft_model(
    spec: SpeculativeConfig, target: ModelConfig, target_tokenizer: Any, dtype: str, device: str,
    use_kernels: bool,
) -> tuple[LlamaModel, ModelConfig]:
    """The draft model of a "draft_model" config, through the target's own loader, validated against it.
    dtype: the target's (a config dtype name), unless the config names the draft's own."""
    assert spec.model is not None  # SpeculativeConfig requires it for this method
    draft_config = load_model_config(spec.model)  # a bad directory fails here, naming the file
    check_draft_config(draft_config, target, spec.model)
    check_draft_tokenizer(_optional_tokenizer(spec.model), target_tokenizer, spec.model)
    draft_dtype = spec.dtype if spec.dtype is not None else dtype
    model, config = load_model(
        spec.model, dtype=TORCH_DTYPES[draft_dtype], device=device, quantization=spec.quantization,
        use_kernels=use_kernels,
    )
    logger.info("draft model %s: %d layers, %s, quantization %s", spec.model, config.num_layers,
                draft_dtype, spec.quantization)
    return model, config


def _optional_tokenizer(path: str) -> Any | None:
    return load_tokenizer(path) if has_tokenizer(path) else None


@dataclass(frozen=True)
class _FollowRows:
    """What `follow` computes for one request: its tokens and their attention queries."""

    request: Request
    start: int  # the position of its first token
    token_ids: list[int]
    query_lens: list[int]  # the known tokens as the target's step took them, then one row per kept token
    kept: list[int]  # the tokens the step appended (empty: none, or the newest has no slot)

    def proposes(self, k: int) -> bool:
        """Does its newest token's draft open the next step's proposal? Not under a grammar (the matcher
        stands before this step's tokens until the scheduler advances it), nor without room for drafts."""
        return bool(self.kept) and self.request.grammar is None and draft_room(self.request, k, len(self.kept)) > 0


@dataclass(frozen=True)
class _NewestWritten:
    """`follow` wrote a request's newest token's K/V, at its slot, when the request had num_tokens tokens
    (a preemption since then freed that slot). While it holds, that token needs no draft forward again, and
    the first draft `follow` sampled from it opens the next proposal."""

    num_tokens: int
    num_preemptions: int

    @staticmethod
    def of(request: Request, num_pending: int = 0) -> _NewestWritten:
        return _NewestWritten(request.num_tokens + num_pending, request.num_preemptions)


@dataclass(frozen=True)
class _FirstDraft:
    """A request's first draft, sampled by `follow` from its newest token."""

    token_id: int
    q: torch.Tensor | None  # the distribution it was drawn from (random requests)
    alternatives: list[int]  # the draft's next likeliest tokens there (unconstrained requests)


@dataclass
class _Drafting:
    """One request's proposal in progress."""

    request: Request
    room: int  # drafts wanted
    block_table: list[int]
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q per draft (random requests only)
    alternatives: list[int] = field(default_factory=list)  # to the first draft (`_alternatives`)
    grammar_steps: int = 0  # tokens its matcher advanced along the drafts (rolled back at the end)

    @property
    def next_position(self) -> int:
        """The position of the token this forward feeds: the last known token, then each draft."""
        return self.request.num_tokens - 1 + len(self.tokens)

    @property
    def next_input(self) -> int:
        return self.tokens[-1] if self.tokens else self.request.all_token_ids[-1]

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.room


class DraftModelProposer:
    """Proposes with a draft model (a `Proposer`) and keeps its KV cache in step with the target's."""

    def __init__(
        self, model: LlamaModel, config: SpeculativeConfig, num_blocks: int, block_size: int, max_num_seqs: int,
        max_model_len: int, structured: StructuredOutputs | None = None, device: str = "cpu",
        cache_dtype: str = "auto", calculate_kv_scales: bool = False,
    ) -> None:
        """cache_dtype, calculate_kv_scales: the draft's KV format, the target's (the pool pays for both in it)."""
        if model.config.max_position_embeddings < max_model_len:
            raise DraftMismatch(
                f"draft model {config.model}: max_position_embeddings {model.config.max_position_embeddings} is "
                f"below max_model_len {max_model_len}; pass a max_model_len the draft can hold"
            )
        self.model = model
        self.k = config.num_speculative_tokens
        self.num_candidates = config.first_token_candidates or 1
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.structured = structured
        self.device = device
        self.windows = set(model.config.sliding_windows) or {None}
        # Scratch: a request needs at most ceil(k / block_size) blocks past its own to propose k tokens.
        num_drafting = min(max_num_seqs, config.disable_by_batch_size or max_num_seqs)
        self.num_scratch_blocks = num_drafting * -(-self.k // block_size)
        num_slots = (num_blocks + self.num_scratch_blocks) * block_size
        # Not zero-filled (as the target's): attention reads only slots written before.
        self.kv_caches: list[LayerKV] = [
            LayerKV.allocate(num_slots, model.config.num_kv_heads, model.config.head_dim, model.dtype, cache_dtype,
                             device, calculate_kv_scales)
            for _ in range(model.config.num_layers)
        ]
        self.disable_by_batch_size = config.disable_by_batch_size
        self._proposals: dict[str, list[Proposal]] = {}
        self._first_drafts: dict[str, _FirstDraft] = {}
        self._newest_written: dict[str, _NewestWritten] = {}

    # --- the runner's side: the draft's KV follows the target's ------------------------------------

    @torch.inference_mode()
    def follow(self, scheduled: Sequence[ScheduledRequest], kept: Mapping[str, Sequence[int]]) -> None:
        """The draft over what the target's step kept, after it sampled: each request's known tokens, its
        accepted drafts and its newest token, at the target's slots; and the first draft of the next step
        for each request that may speculate, from the newest token's logits. kept: by request id, the
        tokens the step accepted for each request that sampled (ModelRunnerOutput.sampled_token_ids)."""
        batch = [self._follow_rows(item, kept.get(item.request.request_id, ())) for item in scheduled]
        self._newest_written = {
            rows.request.request_id: _NewestWritten.of(rows.request, len(rows.kept)) for rows in batch if rows.kept
        }
        batch = [rows for rows in batch if rows.token_ids]
        if not batch:
            self._first_drafts = {}
            return
        layout = QueryLayout()
        for rows in batch:
            layout.add(rows.start, rows.query_lens, rows.request.block_ids)
        meta = layout.metadata(self.block_size, self.windows)
        input_ids = torch.tensor([t for rows in batch for t in rows.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta.positions.to(self.device), self.kv_caches, meta)
        self._first_drafts = self._sample_first_drafts(batch, hidden)

    def _follow_rows(self, item: ScheduledRequest, kept_tokens: Sequence[int]) -> _FollowRows:
        """The tokens `follow` computes for one scheduled request. A decode's last known token is left out
        when the last `follow` wrote it (as that step's newest); the newest token is left out where its slot
        lies past the request's blocks (then the next proposal starts from it, as without `follow`)."""
        request = item.request
        start = request.num_computed_tokens
        known = item.input_token_ids()[: item.num_known_tokens]
        if item.is_decode and self._wrote_newest(request):
            start, known = start + 1, []
        kept = list(kept_tokens)
        known_lens = [len(known)] if known else []
        if start + len(known) + len(kept) > len(request.block_ids) * self.block_size:
            return _FollowRows(request, start, known + kept[:-1], known_lens + [1] * (len(kept) - 1), [])
        return _FollowRows(request, start, known + kept, known_lens + [1] * len(kept), kept)

    def _sample_first_drafts(self, batch: list[_FollowRows], hidden: torch.Tensor) -> dict[str, _FirstDraft]:
        if self.disable_by_batch_size is not None and len(batch) > self.disable_by_batch_size:
            return {}  # too many requests for the next step to speculate
        rows, indices, end = [], [], 0
        for follow_rows in batch:
            end += len(follow_rows.token_ids)
            if follow_rows.proposes(self.k):
                rows.append(follow_rows)
                indices.append(end - 1)
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(indices, device=self.device)])
        sample_rows = [SampleRow(r.request, r.kept) for r in rows]
        token_ids, probs = sample_draft(logits, build_sampling_metadata(sample_rows, logits.shape[1], None))
        first_drafts, random_index = {}, 0
        for r, token_id, row_logits in zip(rows, token_ids, logits):
            q = None
            if r.request.params.temperature >= GREEDY_EPS:
                q, random_index = probs[random_index], random_index + 1
            alternatives = self._alternatives(r.request, row_logits, token_id)
            first_drafts[r.request.request_id] = _FirstDraft(token_id, q, alternatives)
        return first_drafts

    def _alternatives(self, request: Request, logits: torch.Tensor, token_id: int) -> list[int]:
        """The draft's likeliest tokens other than `token_id` at a first draft's position, up to
        first_token_candidates in all. An alternative is kept only where it equals the token the target's
        row there gives anyway (its argmax, or what rejection sampling of the first draft gives), and the
        alternatives depend only on the context and the draft's own draw, never on the target's randomness:
        so the row after a kept one samples the target's distribution given it, as decoding would.
        Unconstrained requests only: a grammar's mask is not at hand here."""
        if self.num_candidates == 1 or request.grammar is not None:
            return []
        top = logits.topk(self.num_candidates).indices.tolist()
        return [t for t in top if t != token_id][: self.num_candidates - 1]

    def _wrote_newest(self, request: Request) -> bool:
        """Did the last `follow` write the K/V of the request's newest token, which it still has?"""
        return self._newest_written.get(request.request_id) == _NewestWritten.of(request)

    def proposal(self, request_id: str, index: int, token_id: int) -> Proposal | None:
        """The proposal behind a sampled request's draft number `index` (None for a greedy request)."""
        proposals = self._proposals.get(request_id)
        if proposals is None:
            return None
        proposal = proposals[index]
        assert proposal.token_id == token_id, "a checked draft is not the one proposed"
        return proposal

    # --- the speculator's side: proposing ----------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        """Up to k drafts for each decoding request: room-limited, and cut where a grammar ends."""
        drafting = self._start(requests)
        active = [d for d in drafting if not d.done]
        try:
            while active:
                self._draft_one_token(active)
                active = [d for d in active if not d.done]
        finally:
            for d in drafting:
                if d.grammar_steps:
                    assert d.request.grammar is not None
                    _rollback(d.request.grammar, d.grammar_steps)
        self._proposals = {
            d.request.request_id: [Proposal(t, q) for t, q in zip(d.tokens, d.probs)]
            for d in drafting if d.probs
        }
        return [Draft(d.tokens, d.alternatives) for d in drafting]

    def finished(self, request: Request) -> None:
        pass  # the draft's KV blocks are the target's block table's twins: the scheduler frees them

    def _start(self, requests: Sequence[Request]) -> list[_Drafting]:
        drafting, next_scratch = [], self.num_blocks
        scratch_end = self.num_blocks + self.num_scratch_blocks
        for request in requests:
            room = draft_room(request, self.k)
            # Positions num_tokens - 1 ... num_tokens - 2 + room are written: that many slots must exist.
            num_slots = request.num_tokens - 1 + room
            missing = max(0, -(-num_slots // self.block_size) - len(request.block_ids))
            if next_scratch + missing > scratch_end:
                room, missing = 0, 0  # cannot happen with the scratch sized for max_num_seqs; no drafts
            scratch = list(range(next_scratch, next_scratch + missing))
            next_scratch += missing
            d = _Drafting(request, room, [*request.block_ids, *scratch])
            first = self._first_drafts.get(request.request_id)
            if room and first is not None and self._wrote_newest(request):
                d.tokens.append(first.token_id)
                d.alternatives = first.alternatives
                if first.q is not None:
                    d.probs.append(first.q)
            drafting.append(d)
        return drafting

    def _draft_one_token(self, active: list[_Drafting]) -> None:
        """One draft forward: each active request's newest token in, its next draft out."""
        seq_lens = [d.next_position + 1 for d in active]
        meta = build_metadata([1] * len(active), seq_lens, [d.block_table for d in active], self.block_size,
                              self.windows)
        input_ids = torch.tensor([d.next_input for d in active], dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta.positions.to(self.device), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        rows = [SampleRow(d.request, d.tokens) for d in active]
        token_ids, probs = sample_draft(logits, build_sampling_metadata(rows, logits.shape[1], self._masks(active)))
        random_index = 0
        for d, token_id, row_logits in zip(active, token_ids, logits):
            if d.request.params.temperature >= GREEDY_EPS:
                d.probs.append(probs[random_index])
                random_index += 1
            if not d.tokens:
                d.alternatives = self._alternatives(d.request, row_logits, token_id)
            d.tokens.append(token_id)
            self._advance_grammar(d, token_id)

    def _masks(self, active: list[_Drafting]) -> torch.Tensor | None:
        """The constrained requests' masks after their drafts so far (their matchers stand there)."""
        matchers = [d.request.grammar for d in active if d.request.grammar is not None]
        if not matchers or self.structured is None:
            return None
        # A failed matcher's rows allow every token; its draft is then refused below, and the target's mask
        # fails its request alone.
        return self.structured.fill_bitmask(matchers).bitmask

    @staticmethod
    def _advance_grammar(d: _Drafting, token_id: int) -> None:
        grammar = d.request.grammar
        if grammar is None:
            return
        try:
            accepted = grammar.accept_tokens([token_id])
        except GrammarStateError:  # the matcher broke: the target's step fails this request alone
            accepted = False
        if not accepted:  # the mask allowed it; refused anyway: draft no further
            d.tokens.pop()
            d.probs = d.probs[: len(d.tokens)]
            d.room = len(d.tokens)
            return
        d.grammar_steps += 1
        if grammar.is_terminated():  # nothing may follow the grammar's end
            d.room = len(d.tokens)


def _rollback(grammar: GrammarMatcher, num_tokens: int) -> None:
    """Back to where drafting began; a matcher that broke meanwhile is left to the target's step to report."""
    with contextlib.suppress(GrammarStateError):
        grammar.rollback(num_tokens)
