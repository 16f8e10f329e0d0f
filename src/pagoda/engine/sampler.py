"""Logits -> token ids (+ logprobs), vectorised over the batch, with no RNG state carried over.

Randomness is a pure function of (request seed, output position): each sampled row draws its Gumbel
noise from a generator seeded with a hash of the two, and the sample is argmax(logits / T + gumbel).
So a seeded request gives the same tokens whatever else shares its batch, and after a preemption
recomputes it. Greedy rows draw nothing.

A speculating request samples several rows in one step, one per position; each row sees the output as
it would stand at its position (the drafts before it counted as output), so each samples what
non-speculative decoding would sample there. A random row that checks a model's draft (a `Proposal`: the
token and the distribution q the draft model drew it from) instead keeps the draft with probability
min(1, p/q) and otherwise draws from normalise(max(0, p - q)): the kept token is then distributed as p.
`sample_draft` is the draft model's side: the same processing (penalties, bias, grammar mask, temperature,
top-k/p, min-p) on its logits, its own noise, and q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagoda.engine.api import best_logprobs
from pagoda.engine.core.request import Request
from pagoda.sampling import GREEDY_EPS
from pagoda.structured.bitmask import apply_bitmask

_MASK64 = (1 << 64) - 1
# Independent random streams derived from a row's (seed, position) draw seed: _draw_seed(draw_seed, stream).
_DRAFT_STREAM = 1  # the draft model's Gumbel noise
_ACCEPT_STREAM = 2  # the uniform that accepts or rejects a model draft


@dataclass
class SamplingMetadata:
    # Rows that sample at random (temperature > 0); the others take the argmax. Fields below are
    # per random row, in this order.
    random_rows: torch.Tensor  # [R] long
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [R] float32; None if no row uses it
    min_p: torch.Tensor | None
    draw_seeds: list[int]  # [R] generator seed of each row's draw: hash of (request seed, output position)
    num_logprobs: list[int | None]  # per row: top-k logprobs asked for, None for none
    penalties: PenaltyMetadata | None
    # Rows under a grammar, and their allowed tokens: row i of the bitmask is the mask of grammar_rows[i].
    grammar_rows: list[int]
    grammar_bitmask: torch.Tensor | None  # int32 [len(grammar_rows), words]; None when no row is constrained
    # Random rows that check a model's draft, as indices into random_rows, with each one's proposal.
    proposal_rows: list[int] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)


@dataclass(frozen=True)
class Proposal:
    """A draft model's token at one position and the distribution q it was drawn from ([V] float32)."""

    token_id: int
    probs: torch.Tensor


@dataclass
class PenaltyMetadata:
    output_counts: torch.Tensor  # [B, V] occurrences of each token in the output so far
    seen: torch.Tensor  # [B, V] bool: in prompt or output (repetition penalty)
    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    bias: torch.Tensor  # [B, V] additive logit bias, with -inf on tokens banned until min_tokens


@dataclass(frozen=True)
class SampleRow:
    """One row to sample: a request at one output position, with the drafts before that position this step."""

    request: Request
    drafts_before: Sequence[int] = ()
    proposal: Proposal | None = None  # a model draft checked at this position (used by random rows only)

    @property
    def position(self) -> int:
        """The output position this row samples."""
        return self.request.num_output_tokens + len(self.drafts_before)

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.drafts_before]

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.request.all_token_ids, *self.drafts_before]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: chosen token and top-k, when asked


def build_sampling_metadata(
    rows: Sequence[Request | SampleRow], vocab_size: int, grammar_bitmask: torch.Tensor | None = None
) -> SamplingMetadata:
    """rows: a Request samples at its next output position. grammar_bitmask: the allowed tokens of the
    constrained rows (those whose request has a grammar), in order."""
    sample_rows = [row if isinstance(row, SampleRow) else SampleRow(row) for row in rows]
    requests = [row.request for row in sample_rows]
    random = [i for i, r in enumerate(requests) if r.params.temperature >= GREEDY_EPS]
    params = [requests[i].params for i in random]
    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    proposal_rows = [index for index, row in enumerate(random) if sample_rows[row].proposal is not None]
    return SamplingMetadata(
        random_rows=torch.tensor(random, dtype=torch.long),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params]) if use_top_k else None,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32) if use_top_p else None,
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32) if use_min_p else None,
        draw_seeds=[_draw_seed(requests[i].seed, sample_rows[i].position) for i in random],
        num_logprobs=[r.params.logprobs for r in requests],
        penalties=_build_penalties(sample_rows, vocab_size),
        grammar_rows=[i for i, r in enumerate(requests) if r.grammar is not None],
        grammar_bitmask=grammar_bitmask,
        proposal_rows=proposal_rows,
        proposals=[_proposal(sample_rows[random[index]]) for index in proposal_rows],
    )


def _proposal(row: SampleRow) -> Proposal:
    assert row.proposal is not None
    return row.proposal


def _draw_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): distinct, well-mixed generator seeds for every draw."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _needs_penalties(row: SampleRow) -> bool:
    p = row.request.params
    return bool(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
        or (p.min_tokens and row.position < p.min_tokens)
    )


def _build_penalties(rows: list[SampleRow], vocab_size: int) -> PenaltyMetadata | None:
    if not any(_needs_penalties(row) for row in rows):
        return None
    batch = len(rows)
    counts = torch.zeros(batch, vocab_size)
    seen = torch.zeros(batch, vocab_size, dtype=torch.bool)
    bias = torch.zeros(batch, vocab_size)
    for index, row in enumerate(rows):
        request, p = row.request, row.request.params
        output_token_ids = row.output_token_ids
        if output_token_ids:
            ids = torch.tensor(output_token_ids)
            counts[index].index_add_(0, ids, torch.ones(len(ids)))
        if p.repetition_penalty != 1.0:
            seen[index, torch.tensor(row.all_token_ids)] = True
        for token_id, value in (p.logit_bias or {}).items():
            bias[index, token_id] += value
        if row.position < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
            bias[index, list(banned)] = float("-inf")
    requests = [row.request for row in rows]
    return PenaltyMetadata(
        output_counts=counts,
        seen=seen,
        presence=_column([r.params.presence_penalty for r in requests]),
        frequency=_column([r.params.frequency_penalty for r in requests]),
        repetition=_column([r.params.repetition_penalty for r in requests]),
        bias=bias,
    )


def _column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> torch.Tensor:
    # Repetition (HF/vLLM semantics): shrink the logits of every token seen in prompt or output.
    penalised = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
    logits = torch.where(pen.seen, penalised, logits)
    logits = logits - pen.frequency * pen.output_counts - pen.presence * (pen.output_counts > 0)
    return logits + pen.bias


def gumbel_noise(draw_seeds: list[int], vocab_size: int) -> torch.Tensor:
    """[R, V] Gumbel(0, 1) draws, each row from its own freshly seeded generator."""
    noise = torch.empty(len(draw_seeds), vocab_size)
    generator = torch.Generator()
    for row, seed in enumerate(draw_seeds):
        generator.manual_seed(seed)
        noise[row].uniform_(generator=generator)
    # uniform_ may return exactly 0: -log(-log(0)) = -inf, a token that simply never wins.
    return -torch.log(-torch.log(noise))


def _filter(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Masks tokens outside top-k / top-p / min-p with -inf (on temperature-scaled logits)."""
    if meta.top_k is not None:
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (meta.top_k - 1).clamp(max=logits.shape[1] - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if meta.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= meta.top_p[:, None]
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    if meta.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """logits: [B, V] float32 for the rows that sample this step."""
    logits, raw_logits = _processed(logits, meta), logits
    token_ids = logits.argmax(dim=-1)
    if meta.random_rows.numel():
        scaled = _scaled(logits, meta)
        noise = gumbel_noise(meta.draw_seeds, logits.shape[1])
        drawn = (scaled + noise).argmax(dim=-1)
        if meta.proposal_rows:
            drawn[meta.proposal_rows] = _check_proposals(scaled, noise, meta)
        token_ids[meta.random_rows] = drawn
    return SamplerOutput(token_ids.tolist(), _logprobs(raw_logits, token_ids, meta))


def sample_draft(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[list[int], torch.Tensor]:
    """A draft model's tokens: as `sample` would draw them from these logits, with the draft's own noise.
    Returns the token ids and q, the distribution each random row drew from ([R, V], in random-row order)."""
    logits = _processed(logits, meta)
    token_ids = logits.argmax(dim=-1)
    probs = torch.empty(0, logits.shape[1])
    if meta.random_rows.numel():
        scaled = _scaled(logits, meta)
        noise = gumbel_noise([_draw_seed(seed, _DRAFT_STREAM) for seed in meta.draw_seeds], logits.shape[1])
        token_ids[meta.random_rows] = (scaled + noise).argmax(dim=-1)
        probs = scaled.softmax(dim=-1)
    return token_ids.tolist(), probs


def _processed(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalties, bias and grammar masks applied: what the argmax and the random rows start from."""
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    if meta.grammar_bitmask is not None:
        logits = _apply_grammar_masks(logits, meta.grammar_bitmask, meta.grammar_rows)
    return logits


def _scaled(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The random rows' logits over temperature, top-k/p and min-p applied: softmax of this is p."""
    return _filter(logits[meta.random_rows] / meta.temperature[:, None], meta)


def _check_proposals(scaled: torch.Tensor, noise: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Rejection sampling of the model drafts at meta.proposal_rows: keep draft x with probability
    min(1, p(x)/q(x)), else draw from normalise(max(0, p - q)) with the row's own noise. Either way the
    token is distributed as p; each row's randomness is a function of its (seed, position) only."""
    rows = torch.tensor(meta.proposal_rows, dtype=torch.long)
    p = scaled[rows].softmax(dim=-1)
    q = torch.stack([proposal.probs for proposal in meta.proposals])
    drafts = torch.tensor([proposal.token_id for proposal in meta.proposals], dtype=torch.long)
    p_draft, q_draft = p.gather(1, drafts[:, None])[:, 0], q.gather(1, drafts[:, None])[:, 0]
    uniform = torch.tensor([_uniform(_draw_seed(meta.draw_seeds[row], _ACCEPT_STREAM)) for row in meta.proposal_rows])
    accept = uniform * q_draft < p_draft  # u < p/q without dividing: q(x) > 0 for a drawn x, bar underflow
    residual = (p - q).clamp(min=0.0)
    # p == q up to rounding leaves no residual mass; a rejection is then (nearly) impossible: draw from p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    resampled = (residual.log() + noise[rows]).argmax(dim=-1)
    return torch.where(accept, drafts, resampled)


def _uniform(seed: int) -> float:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return float(torch.rand(1, generator=generator))


def _apply_grammar_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Logits with the constrained rows masked (a new tensor: logprobs stay the raw distribution's).
    bitmask row i is the mask of logits row rows[i]: it is applied to the constrained rows gathered."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    constrained = logits.index_select(0, index)
    apply_bitmask(constrained, bitmask)
    return logits.index_copy(0, index, constrained)


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, meta: SamplingMetadata) -> list[dict[int, float] | None]:
    """The chosen token's logprob and the top-k, from the model's raw distribution (as vLLM)."""
    wanted = [k for k in meta.num_logprobs if k is not None]
    if not wanted:
        return [None] * len(token_ids)
    rows = top_logprobs(logits, token_ids, max(wanted))
    return [None if k is None else _trim(row, k) for k, row in zip(meta.num_logprobs, rows)]


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row: {token id: logprob, then the top-k ids: logprobs} from log_softmax(logits).

    The chosen token comes first; it appears once, so a row has k or k + 1 entries.
    """
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(max(k, 1), dim=-1)
    rows = zip(token_ids.tolist(), chosen, top_ids.tolist(), top_values.tolist())
    return [{token_id: lp, **dict(zip(ids[:k], values[:k]))} for token_id, lp, ids, values in rows]


def _trim(row: dict[int, float], k: int) -> dict[int, float]:
    """A row built for a larger k, cut to the chosen token plus the k best."""
    chosen_id, chosen_lp = next(iter(row.items()))
    return {chosen_id: chosen_lp, **dict(best_logprobs(row, k))}
