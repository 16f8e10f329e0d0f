"""The runner's side of embedding requests: which rows of the final hidden states a step needs, and the pooled
vectors they add up to.

A prompt may be computed over several steps (chunked prefill), so each request's pooling state is carried
from chunk to chunk: a running fp32 sum for mean pooling (the count is the prompt length), the first position's
vector for CLS; last-token pooling needs only the chunk that ends the prompt. A chunk starting at position 0
starts the state afresh, so a preempted request, recomputed from the start, is pooled once. Mean and CLS
pooling never start past 0: the engine turns prefix hits off for them (pooling.PoolingConfig.uses_prefix_hits).

The hidden states are the model's final norm's output (what transformers' AutoModel returns as
last_hidden_state); the vector is truncated to `dimensions`, then L2-normalized where asked, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.engine.core.request import Request
from pagoda.engine.core.scheduler import ScheduledRequest


@dataclass
class _Chunk:
    item: ScheduledRequest
    first: int  # index of its first row among the step's hidden rows
    count: int


@dataclass
class PoolingPlan:
    """One step's pooling work: the flat batch's rows whose hidden states it needs, by request."""

    rows: list[int] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)


class Pooler:
    def __init__(self) -> None:
        # request id -> (its request, mean's running sum or CLS's vector), while its prompt is being computed
        self._states: dict[str, tuple[Request, torch.Tensor]] = {}

    def plan(self, scheduled: list[ScheduledRequest]) -> PoolingPlan:
        plan = PoolingPlan()
        row = 0
        for item in scheduled:
            request, pooling = item.request, item.request.pooling
            if pooling is not None:
                start = request.num_computed_tokens
                if pooling.method == "mean":
                    rows = list(range(row, row + item.num_tokens))
                elif pooling.method == "cls":
                    rows = [row] if start == 0 else []
                else:
                    rows = [row + item.num_tokens - 1] if _completes(item) else []
                plan.chunks.append(_Chunk(item, len(plan.rows), len(rows)))
                plan.rows += rows
            row += item.num_tokens
        return plan

    def pool(self, plan: PoolingPlan, hidden: torch.Tensor | None) -> dict[str, list[float]]:
        """Carries each request's state over this step's rows (hidden: those rows' states, in plan order);
        returns the vectors of the requests whose prompt the step completed."""
        self._forget_finished()
        pooled: dict[str, list[float]] = {}
        for chunk in plan.chunks:
            request, pooling = chunk.item.request, chunk.item.request.pooling
            assert pooling is not None
            rows = None if hidden is None else hidden[chunk.first : chunk.first + chunk.count].float()
            start, request_id = request.num_computed_tokens, request.request_id
            if pooling.method == "mean" and rows is not None:
                total = rows.sum(dim=0)
                if start > 0:
                    total = self._state(request) + total
                self._states[request_id] = (request, total)
            elif pooling.method == "cls" and start == 0 and rows is not None:
                self._states[request_id] = (request, rows[0])
            if not _completes(chunk.item):
                continue
            if pooling.method == "last":
                assert rows is not None
                vector = rows[-1]
            else:
                vector = self._states.pop(request_id)[1]
                if pooling.method == "mean":
                    vector = vector / request.num_prompt_tokens
            if pooling.dimensions is not None:
                vector = vector[: pooling.dimensions]
            if pooling.normalize:
                vector = F.normalize(vector, p=2, dim=-1)
            pooled[request_id] = vector.tolist()
        return pooled

    def _state(self, request: Request) -> torch.Tensor:
        held = self._states.get(request.request_id)
        if held is None or held[0] is not request:
            raise RuntimeError(f"request {request.request_id}: a chunk past position 0 without the pooled state of "
                               "the positions before it (a prefix hit on mean pooling?)")
        return held[1]

    def _forget_finished(self) -> None:
        """Drops the state of requests that ended before their prompt did (aborted)."""
        for request_id, (request, _) in list(self._states.items()):
            if request.is_finished:
                del self._states[request_id]


def _completes(item: ScheduledRequest) -> bool:
    request = item.request
    return request.num_computed_tokens + item.num_tokens == request.num_prompt_tokens
