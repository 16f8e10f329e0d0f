"""Rule bounds on output constraints (structured/bounds.py, structured/schema_rules.py), the first-mask check at
compile time, and GrammarLimits as the one source of each limit's default."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from pagoda.cli import build_parser
from pagoda.demo import DEMO_MODEL_DIR
from pagoda.flag_values import show_default
from pagoda.structured import InvalidConstraint, StructuredOutputsParams
from pagoda.structured import llguidance_backend as backend_module
from pagoda.structured.bounds import bounds_problem
from pagoda.structured.limits import GrammarLimits, grammar_flag
from pagoda.structured.llguidance_backend import LLGuidanceBackend

LIMITS = GrammarLimits()


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def problem(**constraint) -> str | None:
    return bounds_problem(StructuredOutputsParams(**constraint), LIMITS)


@pytest.mark.parametrize(("constraint", "named"), [
    ({"regex": "x{4294967295}"}, "--grammar-max-repeat"),
    ({"regex": "(x{1000}){1000}"}, "--grammar-max-repeat"),  # nested counts multiply
    ({"regex": "(a(b{200}){60})"}, "--grammar-max-repeat"),
    ({"json": {"type": "string", "pattern": "^x{20000}$"}}, "--grammar-max-repeat"),
    ({"json": {"type": "array", "minItems": 10001}}, "--grammar-max-repeat"),
    ({"grammar": 'start: /x{20000}/'}, "--grammar-max-repeat"),
    ({"grammar": 'start: item~5..20000\nitem: "b"'}, "--grammar-max-repeat"),
    ({"json": nested(32)}, "--grammar-max-schema-depth"),
    ({"json": {"enum": list(range(4097))}}, "--grammar-max-alternatives"),
    ({"json": {"anyOf": [{"const": i} for i in range(4097)]}}, "--grammar-max-alternatives"),
    ({"choice": [str(i) for i in range(4097)]}, "--grammar-max-alternatives"),
])
def test_past_a_numeric_bound_the_message_names_the_limit_and_its_flag(constraint, named):
    message = problem(**constraint)
    assert message is not None and named in message


@pytest.mark.parametrize("constraint", [
    {"regex": r"\d{1,20}-[{}]{3}\p{Greek}\x{41}{2}"},  # braces of escapes and classes are not repeats
    {"regex": "(x{100}){100}"},  # 10000: at the bound
    {"json": nested(31)},  # 63 levels
    {"json": {"type": "string", "maxLength": 10**9}},  # maximums are lazy in llguidance: not bounded
    {"json": {"enum": list(range(4096))}},
    {"grammar": 'start: "x{99999}"'},  # inside a string literal: text, not a repeat
])
def test_within_the_bounds_nothing_is_refused(constraint):
    assert problem(**constraint) is None


@pytest.mark.parametrize(("schema", "says"), [
    ({"$ref": "#"}, "$ref cycle"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "$ref cycle"),
    ({"anyOf": [{"$ref": "#"}, {"type": "string"}]}, "$ref cycle"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "cannot end"),
    ({"$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
     "cannot end"),
    # Reachable only through an optional property, an endless branch still traps the output once entered.
    ({"type": "object", "properties": {"opt": {"$ref": "#/$defs/loop"}},
      "$defs": {"loop": {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}}, "required": ["x"]}}},
     "cannot end at #/properties/opt"),
])
def test_recursion_that_cannot_run_is_refused(schema, says):
    message = problem(json=schema)
    assert message is not None and says in message


@pytest.mark.parametrize("schema", [
    {"$defs": {"node": {"type": "object", "properties": {"children": {"type": "array",
                                                                      "items": {"$ref": "#/$defs/node"}}}}},
     "$ref": "#/$defs/node"},  # a tree: children may be empty
    {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["next"]},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional recursion
    {"$defs": {"unused": {"$ref": "#/$defs/unused"}}, "type": "string"},  # never reached
])
def test_recursion_that_can_end_is_allowed(schema):
    assert problem(json=schema) is None


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_a_grammar_that_fails_at_its_first_mask_is_refused_when_it_compiles(tokenizer, monkeypatch):
    monkeypatch.setattr(backend_module, "bounds_problem", lambda params, limits: None)  # the rules off
    backend = LLGuidanceBackend(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])
    with pytest.raises(InvalidConstraint, match="fails at its first token") as raised:
        backend.compile(StructuredOutputsParams(json={"$ref": "#"}, error_param="response_format"))
    assert raised.value.param == "response_format"


def test_an_exception_from_the_grammar_engine_is_a_refusal_naming_the_field(tokenizer):
    limits = GrammarLimits(max_schema_depth=1000)
    backend = LLGuidanceBackend(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id],
                                limits=limits)
    with pytest.raises(InvalidConstraint, match="recursion limit") as raised:
        backend.compile(StructuredOutputsParams(json=nested(64), error_param="tools"))
    assert raised.value.param == "tools"


def test_each_limit_has_a_flag_whose_help_gives_the_dataclass_default():
    serve = next(action for action in build_parser()._actions if action.dest == "command").choices["serve"]
    by_flag = {flag: action for action in serve._actions for flag in action.option_strings}
    for item in dataclasses.fields(GrammarLimits):
        action = by_flag[grammar_flag(item.name)]
        assert action.default is None  # not given: GrammarLimits' default applies
        assert f"(default {show_default(item.default)})" in action.help


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_repeat"):
        GrammarLimits(max_repeat=0)
