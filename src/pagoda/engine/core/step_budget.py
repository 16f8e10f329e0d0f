"""How much prefill a step may take while requests decode: a step-time target and an online cost model.

Every decoding stream waits for the whole step, so a step's prefill chunk is every stream's stall. While
anything decodes, the scheduler asks `prefill_token_cap` how many prefill tokens fit in the step so that
its predicted time stays within the target; when nothing decodes, prefill takes the whole token budget.
Pure Python; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# When the decodes alone are predicted to take longer than the target, prefill may still take as long as
# they do (the step at most doubles): new requests keep progressing at half speed or better, instead of
# waiting for every stream to finish.
PREFILL_FLOOR_SHARE = 1.0


@dataclass
class PrefillAllowance:
    """One step's limits on prefill work: all chunks together (`left`) and each request's (`per_request`)."""

    left: int
    per_request: int

    def chunk(self, wanted: int, budget: int) -> int:
        return min(wanted, budget, self.left, self.per_request)


class StepCostModel(Protocol):
    """Predicts a step's wall time from its token count, learning from the steps it is shown."""

    def observe(self, num_tokens: int, seconds: float) -> None: ...

    def predict(self, num_tokens: int) -> float | None:
        """Seconds for a step of this many tokens; None until it has seen a step."""
        ...

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may hold and be predicted to take at most `seconds`; None until it knows."""
        ...


@dataclass
class LinearStepCost:
    """seconds = fixed + per_token x tokens, learnt online from the steps the engine measures.

    per_token is learnt only from steps of at least `min_slope_tokens` tokens (a burst of prompts, a long
    chunk), where the fixed part is a small share, as (seconds - fixed) / tokens. fixed is learnt from
    every step as seconds - per_token x tokens: on a CPU it is mostly streaming the weights once (what a
    decode-only step costs), and it follows the host's load step by step. A regression over all steps
    cannot separate the two: a capped scheduler makes steps all about the same size, where noise decides
    the slope (and a slope that comes out too low lets through a chunk that stalls every stream). Until
    it has seen one large step the model predicts nothing, so nothing is capped: that step is how it
    learns. Each estimate is an exponential moving average (`decay`: the weight the old value keeps).
    """

    slope_decay: float = 0.7
    fixed_decay: float = 0.8
    min_slope_tokens: int = 256
    per_token: float | None = None
    fixed: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= self.min_slope_tokens:
            # A stale fixed part (the host got faster) is never credited with more than half the step.
            sample = max(seconds - (self.fixed or 0.0), 0.5 * seconds) / num_tokens
            first = self.per_token is None
            self.per_token = sample if self.per_token is None else _average(self.per_token, sample, self.slope_decay)
            if first:
                return  # its residual is 0 by construction: it says nothing about the fixed part
        if self.per_token is not None:
            residual = max(seconds - self.per_token * num_tokens, 0.0)
            self.fixed = residual if self.fixed is None else _average(self.fixed, residual, self.fixed_decay)

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before the first large step."""
        if self.per_token is None:
            return None
        return self.fixed or 0.0, self.per_token

    def predict(self, num_tokens: int) -> float | None:
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * num_tokens

    def tokens_within(self, seconds: float) -> int | None:
        fit = self.coefficients()
        if fit is None:
            return None
        fixed, per_token = fit
        return max(int((seconds - fixed) / per_token + 1e-6), 0)  # + 1e-6: 49.99999 tokens are 50


def _average(old: float, new: float, decay: float) -> float:
    return decay * old + (1 - decay) * new


def prefill_token_cap(cost: StepCostModel, num_decodes: int, target_s: float) -> int | None:
    """Prefill tokens a step with `num_decodes` decoding requests may add; None: no cap (nothing decodes,
    no target, or the model has seen no step yet). At least 1, so that prefill always progresses."""
    if num_decodes == 0 or target_s <= 0:
        return None
    decodes_s = cost.predict(num_decodes)
    if decodes_s is None:
        return None
    allowed_s = max(target_s, (1 + PREFILL_FLOOR_SHARE) * decodes_s)
    within = cost.tokens_within(allowed_s)
    return None if within is None else max(within - num_decodes, 1)
