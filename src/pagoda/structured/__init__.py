"""Structured outputs (constrained decoding): the engine-independent core.

`params` says what a request asks for, `interface` what a grammar engine provides, `bitmask` how a mask
reaches the logits. The llguidance engine lives in `pagoda.structured.llguidance_backend`, imported on
its own so that validating parameters does not load it.
"""

from pagoda.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_width, unpack_bitmask
from pagoda.structured.interface import CompiledGrammar, GrammarBackend, GrammarMatcher, GrammarStateError
from pagoda.structured.params import (
    CONSTRAINT_KINDS,
    ConstraintKind,
    InvalidConstraint,
    StructuredOutputsParams,
)

__all__ = [
    "CONSTRAINT_KINDS",
    "CompiledGrammar",
    "ConstraintKind",
    "GrammarBackend",
    "GrammarMatcher",
    "GrammarStateError",
    "InvalidConstraint",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_width",
    "unpack_bitmask",
]
