"""StructuredOutputsParams: what a request constrains its output to, with vLLM's field names.

Exactly one constraint is set. Parameters are validated when they are built, so a bad request fails at
the door; whether a grammar engine can compile the constraint is decided later, by its backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json", "json_object", "regex", "choice", "grammar")

# The name errors use when the caller names no parameter of its own (vLLM's request field).
DEFAULT_PARAM = "structured_outputs"

# Key under which compiled grammars are cached: (kind, canonical text of the constraint).
CacheKey = tuple[ConstraintKind, str]


class InvalidConstraint(ValueError):
    """The constraint is malformed or cannot be compiled. `param` names the request field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint. Set exactly one of:

    - `json`: a JSON Schema, as a dict or as JSON text; the output is a JSON value valid against it.
    - `json_object`: True for any JSON object.
    - `regex`: the whole output matches this regular expression (Rust `regex` syntax).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a context-free grammar in llguidance's Lark dialect.

    `error_param`, when given, is the request field every error about these parameters names (e.g.
    "response_format" when they were built from an OpenAI response_format); otherwise errors name
    "structured_outputs.<field>".
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    error_param: str | None = field(default=None, compare=False, repr=False)
    # Computed once, at construction: the caller may mutate the dict in `json` afterwards.
    _kind: ConstraintKind = field(init=False, compare=False, repr=False, default="json")
    _canonical: str = field(init=False, compare=False, repr=False, default="")

    def __post_init__(self) -> None:
        kind = self._single_kind()
        canonical = _CANONICALIZERS[kind](self, self.param_for(kind))
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_canonical", canonical)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))  # frozen means frozen all the way down

    @property
    def kind(self) -> ConstraintKind:
        """Which constraint is set."""
        return self._kind

    def cache_key(self) -> CacheKey:
        """Equal for equal constraints however they were written (a dict or its JSON text, any spacing)."""
        return (self.kind, self._canonical)

    @property
    def canonical_text(self) -> str:
        """The constraint as text: the schema as compact JSON, the choices as a JSON list, else as given."""
        return self._canonical

    def param_for(self, kind: ConstraintKind | None = None) -> str:
        """The request field to name in an error about `kind` (or about the parameters as a whole)."""
        if self.error_param is not None:
            return self.error_param
        return DEFAULT_PARAM if kind is None else f"{DEFAULT_PARAM}.{kind}"

    def __hash__(self) -> int:
        return hash(self.cache_key())

    def _single_kind(self) -> ConstraintKind:
        chosen = [kind for kind in CONSTRAINT_KINDS if _is_set(self, kind)]
        if len(chosen) != 1:
            given = ", ".join(chosen) if chosen else "none"
            raise InvalidConstraint(
                self.param_for(), f"exactly one of {', '.join(CONSTRAINT_KINDS)} must be set (got {given})"
            )
        return chosen[0]


def _is_set(params: StructuredOutputsParams, kind: ConstraintKind) -> bool:
    value = getattr(params, kind)
    if kind == "json_object" and value is False:
        return False  # json_object=False asks for nothing, as if it were absent
    return value is not None


def _canonical_json(params: StructuredOutputsParams, param: str) -> str:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise InvalidConstraint(param, f"the JSON schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict):
        raise InvalidConstraint(param, f"the JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        # Key order is kept: it is meaningful (llguidance emits properties in schema order), so schemas that
        # differ only in order are different constraints and must not share a compiled grammar.
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidConstraint(param, f"the JSON schema cannot be written as JSON: {error}") from None
    except RecursionError:  # nested past Python's recursion limit: far past any depth a grammar allows
        raise InvalidConstraint(param, "the JSON schema is nested too deeply") from None


def _canonical_json_object(params: StructuredOutputsParams, param: str) -> str:
    if not isinstance(params.json_object, bool):
        raise InvalidConstraint(param, f"must be a boolean, got {type(params.json_object).__name__}")
    return ""


def _canonical_regex(params: StructuredOutputsParams, param: str) -> str:
    # " " is a fine regex (one space), so only the empty string is refused: it would allow only EOS.
    return _string(params.regex, param, "regex", non_empty=lambda text: bool(text))


def _canonical_grammar(params: StructuredOutputsParams, param: str) -> str:
    return _string(params.grammar, param, "grammar", non_empty=lambda text: bool(text.strip()))


def _canonical_choice(params: StructuredOutputsParams, param: str) -> str:
    choice = params.choice
    # A bare string is a Sequence[str] too, but a caller who passes one almost surely meant [string].
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence):
        raise InvalidConstraint(param, f"must be a list of strings, got {type(choice).__name__}")
    if not choice:
        raise InvalidConstraint(param, "must contain at least one string")
    for index, item in enumerate(choice):
        if not isinstance(item, str):
            raise InvalidConstraint(param, f"must be a list of strings, item {index} is {type(item).__name__}")
    return json.dumps(list(choice), ensure_ascii=False)


def _string(value: object, param: str, what: str, non_empty: Callable[[str], bool]) -> str:
    if not isinstance(value, str):
        raise InvalidConstraint(param, f"the {what} must be a string, got {type(value).__name__}")
    if not non_empty(value):
        raise InvalidConstraint(param, f"the {what} must not be empty")
    return value


_CANONICALIZERS: dict[ConstraintKind, Callable[[StructuredOutputsParams, str], str]] = {
    "json": _canonical_json,
    "json_object": _canonical_json_object,
    "regex": _canonical_regex,
    "choice": _canonical_choice,
    "grammar": _canonical_grammar,
}
