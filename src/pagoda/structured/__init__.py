"""Structured outputs (constrained decoding): the engine-independent core.

`params` says what a request asks for, `interface` what a grammar engine provides, `bitmask` how a mask
reaches the logits. The package exports only `params` (pure Python): `pagoda.SamplingParams` imports it,
and `import pagoda` must not load torch. The llguidance engine lives in
`pagoda.structured.llguidance_backend`, imported on its own so that validating parameters does not load it.
"""

from pagoda.structured.params import (
    CONSTRAINT_KINDS,
    ConstraintKind,
    InvalidConstraint,
    StructuredOutputsParams,
)

__all__ = ["CONSTRAINT_KINDS", "ConstraintKind", "InvalidConstraint", "StructuredOutputsParams"]
