"""The step-cost model: what stands in for the model's forward pass in a simulated replica.

A step's seconds are a linear function of what the scheduler put in it (`StepShape`): a fixed part (on a CPU
mostly streaming the weights once), a part per prefill token and per decode row (the matmuls), and a part per
key each query attends to (the attention: a decode row reads its whole context, a prefill chunk of n tokens
after o computed ones reads about n x (o + n/2) keys). The coefficients are fitted to measured steps of a
real engine (`benchmarks/sim_calibrate.py`) and stored as JSON, so that a simulation says which machine and
model its times are for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pagoda.engine.core.scheduler import SchedulerOutput

# The fit shipped with pagoda: the built-in model on a 2-vCPU host (benchmarks/sim_calibrate.py).
DEFAULT_STEP_COST = Path(__file__).with_name("step_cost_demo.json")


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the terms the cost model charges for."""

    prefill_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0  # keys read by the decode rows: each one's whole context
    prefill_attention: int = 0  # (query, key) pairs of the prefill chunks, causal

    def terms(self) -> tuple[float, ...]:
        """The regressors, in StepCost's coefficient order (1 for the fixed part)."""
        return 1.0, self.prefill_tokens, self.decode_rows, self.decode_context, self.prefill_attention


def step_shape(output: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step; read before `Scheduler.update` moves the requests' computed counts."""
    prefill_tokens = decode_rows = decode_context = prefill_attention = 0
    for item in output.scheduled:
        done = item.request.num_computed_tokens
        if item.is_decode:
            decode_rows += 1
            decode_context += done + 1
        else:
            prefill_tokens += item.num_tokens
            prefill_attention += item.num_tokens * done + item.num_tokens * (item.num_tokens + 1) // 2
    return StepShape(prefill_tokens, decode_rows, decode_context, prefill_attention)


@dataclass(frozen=True)
class StepCost:
    """seconds = fixed_s + prefill_token_s x prefill tokens + decode_row_s x decode rows
    + decode_context_s x keys the decodes read + prefill_attention_s x prefill (query, key) pairs; and each
    request's request_overhead_s before its replica sees it."""

    fixed_s: float
    prefill_token_s: float = 0.0
    decode_row_s: float = 0.0
    decode_context_s: float = 0.0
    prefill_attention_s: float = 0.0
    # The serving path's time outside the engine's steps (HTTP through the router and the server, admission, the
    # first chunk's way back): a request reaches its replica this long after it was sent.
    request_overhead_s: float = 0.0
    description: str = ""  # which model, dtype and machine the coefficients were measured on

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not value >= 0:  # written so that nan fails too
                raise ValueError(f"step cost {field.name} must be at least 0, got {value!r}")

    def coefficients(self) -> tuple[float, ...]:
        return self.fixed_s, self.prefill_token_s, self.decode_row_s, self.decode_context_s, self.prefill_attention_s

    def seconds(self, shape: StepShape) -> float:
        return sum(c * t for c, t in zip(self.coefficients(), shape.terms()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepCost:
        data = json.loads(Path(path).read_text())
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown step-cost fields {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], description: str = "") -> StepCost:
        """Least squares over measured (shape, seconds), every coefficient at least 0: a term whose free fit
        comes out negative (noise where it barely varies) is dropped and the rest refitted (the fixed part is
        kept, at 0 at least)."""
        if not samples:
            raise ValueError("no measured steps to fit")
        active = list(range(len(samples[0][0].terms())))
        while True:
            solution = _least_squares([[shape.terms()[i] for i in active] for shape, _ in samples],
                                      [seconds for _, seconds in samples])
            negative = [i for i, value in zip(active, solution) if value < 0 and i != 0]
            if not negative:
                break
            active = [i for i in active if i not in negative]
        coefficients = [0.0] * len(samples[0][0].terms())
        for i, value in zip(active, solution):
            coefficients[i] = max(value, 0.0)
        fixed_s, prefill_token_s, decode_row_s, decode_context_s, prefill_attention_s = coefficients
        return cls(fixed_s, prefill_token_s, decode_row_s, decode_context_s, prefill_attention_s,
                   description=description)


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Solves the normal equations (AᵀA) x = Aᵀb by Gaussian elimination with partial pivoting; a column that
    never varies from 0 gets 0."""
    width = len(rows[0])
    # Scaled columns: the terms span ten orders of magnitude (1 to keys²), which the elimination must not see.
    scale = [max((abs(row[j]) for row in rows), default=0.0) or 1.0 for j in range(width)]
    scaled = [[row[j] / scale[j] for j in range(width)] for row in rows]
    matrix = [[sum(r[i] * r[j] for r in scaled) for j in range(width)]
              + [sum(r[i] * b for r, b in zip(scaled, targets))] for i in range(width)]
    for col in range(width):
        pivot = max(range(col, width), key=lambda r: abs(matrix[r][col]))
        matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
        if abs(matrix[col][col]) < 1e-12:
            matrix[col] = [0.0] * width + [0.0]
            matrix[col][col] = 1.0
            continue
        for r in range(width):
            if r != col:
                factor = matrix[r][col] / matrix[col][col]
                matrix[r] = [a - factor * b for a, b in zip(matrix[r], matrix[col])]
    return [matrix[i][width] / matrix[i][i] / scale[i] for i in range(width)]
