"""GrammarLimits: what one output constraint may cost, written once (pure Python: the CLI reads it for --help).

Two kinds of bound. llguidance's own (`LLParserLimits`'s fields, under the same names) bound the work of
compiling a grammar and of each step's mask; a constraint past them fails while it compiles or, worse, in
the middle of generation. pagoda's rule bounds (`max_schema_depth`, `max_repeat`, `max_alternatives`, and
the rules of `structured/bounds.py` that need no number) refuse a constraint before llguidance sees it,
with a message naming the bound, where llguidance would fail late or fail without saying why. And one bound
on what constraints cost together: `cache_chars`, the compiled-grammar cache's share of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _limit(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class GrammarLimits:
    # llguidance's LLParserLimits, same names and meanings.
    max_items_in_row: int = _limit(2000, "llguidance: most Earley items in one row of the parse")
    initial_lexer_fuel: int = _limit(1_000_000, "llguidance: lexer work for a grammar's first mask")
    step_lexer_fuel: int = _limit(200_000, "llguidance: lexer work for one token's mask")
    step_max_items: int = _limit(50_000, "llguidance: most Earley items one token's mask may create")
    max_lexer_states: int = _limit(250_000, "llguidance: most lexer states a grammar may build")
    max_grammar_size: int = _limit(500_000, "llguidance: most symbols in a compiled grammar")
    # pagoda's.
    compile_timeout_s: float = _limit(10.0, "seconds a constraint may take to compile and give its first mask")
    max_schema_depth: int = _limit(64, "deepest nesting of JSON objects and arrays in a JSON schema")
    max_repeat: int = _limit(10_000, "largest repeat count: a regex's {n,m} (nested counts multiplied), a "
                                     "schema's minItems, minLength, minProperties, minContains")
    max_alternatives: int = _limit(4096, "most alternatives in one place: a schema's enum, anyOf or oneOf, "
                                         "a choice list")
    # A compiled grammar's memory grows with its text (~50-200 bytes a character for large ones): the cache of
    # compiled grammars is bounded by their texts' total length, so hostile constraints cannot pin memory.
    cache_chars: int = _limit(65_536, "most characters of constraint text whose compiled grammars are kept for "
                                      "reuse (a longer constraint is compiled for each request)")

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"grammar limit {item.name} must be a positive number, got {value!r}")

    def llparser_limits(self) -> dict[str, int]:
        """llguidance's LLParserLimits keyword arguments."""
        return {name: getattr(self, name) for name in LLPARSER_LIMIT_NAMES}


LLPARSER_LIMIT_NAMES = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                        "max_lexer_states", "max_grammar_size")


# LLM(...)'s option names (and the CLI's, as flags): grammar_ + the field's name.
GRAMMAR_OPTIONS = tuple(f"grammar_{item.name}" for item in fields(GrammarLimits))


def grammar_flag(name: str) -> str:
    """The command-line flag of a GrammarLimits field."""
    return "--grammar-" + name.replace("_", "-")
