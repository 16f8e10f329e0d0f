"""Structured outputs core: parameter validation, llguidance compilation and matching, bitmask application.

Matchers are driven by seeded random walks over the demo model's real tokenizer: at each step the mask is
computed, a random allowed token is taken, and the finished text must satisfy the constraint.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import transformers

import pagoda
from pagoda.structured import InvalidConstraint, StructuredOutputsParams
from pagoda.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_width, unpack_bitmask
from pagoda.structured.interface import GrammarStateError
from pagoda.structured.limits import GrammarLimits
from pagoda.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceGrammar, LLGuidanceMatcher
from pagoda.testing import make_tokenizer

DEMO_DIR = Path(pagoda.__file__).resolve().parent / "assets" / "pagoda-demo"
TOKENIZER_SIZE = len(transformers.AutoTokenizer.from_pretrained(DEMO_DIR))  # added tokens included
# The backends here are built wider than the tokenizer, and not to a multiple of 32: the last 6 ids exist only
# in the model (as when a model pads its embedding), and the last bitmask word is partly padding.
MODEL_VOCAB = TOKENIZER_SIZE + 6
assert MODEL_VOCAB % 32
MAX_WALK_TOKENS = 200
# After this many tokens a walk heads for the exit: EOS when allowed, else closing tokens.
WALK_PATIENCE = 40


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_DIR)


@pytest.fixture(scope="module")
def backend(tokenizer) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[tokenizer.eos_token_id])


def compile_(backend: LLGuidanceBackend, **constraint) -> LLGuidanceGrammar:
    return backend.compile(StructuredOutputsParams(**constraint))


def allowed_tokens(backend: LLGuidanceBackend, matcher: LLGuidanceMatcher) -> list[int]:
    bitmask = allocate_bitmask(1, backend.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, backend.vocab_size)[0].nonzero().flatten().tolist()


def advance_text(backend: LLGuidanceBackend, matcher: LLGuidanceMatcher, text: str) -> None:
    assert matcher.accept_tokens(backend.llg_tokenizer.tokenize_str(text)), text


def decode(backend: LLGuidanceBackend, tokens: list[int]) -> str:
    return backend.llg_tokenizer.decode_bytes(tokens).decode("utf-8")  # strict: the grammar keeps UTF-8 whole


# --------------------------------------------------------------------------------------------------
# Random walks
# --------------------------------------------------------------------------------------------------


# Once a walk has run long, it takes the first tier with an allowed token: a lone quote (closes a string;
# where it opens one, the next step closes it), then pure closers, then anything but whitespace (which
# JSON allows without end).
_EXIT_TIERS = (
    lambda text: text == b'"',
    lambda text: bool(text) and set(text) <= set(b'"}]'),
    lambda text: bool(text),
)


def _pick(rng: random.Random, backend: LLGuidanceBackend, allowed: list[int], step: int) -> int:
    eos = [token for token in allowed if token in backend.eos_token_ids]
    if eos and (step >= WALK_PATIENCE or rng.random() < 0.2):
        return rng.choice(eos)
    candidates = [token for token in allowed if token not in backend.eos_token_ids] or eos
    if step >= WALK_PATIENCE:
        texts = {token: backend.llg_tokenizer.decode_bytes([token]).strip() for token in candidates}
        for in_tier in _EXIT_TIERS:
            tier = [token for token, text in texts.items() if in_tier(text)]
            if tier:
                return rng.choice(tier)
    return rng.choice(candidates)


def random_walk(backend: LLGuidanceBackend, grammar: LLGuidanceGrammar, seed: int) -> str:
    """Text from seeded random allowed tokens until the grammar ends; checks EOS is allowed exactly when it may end."""
    rng = random.Random(seed)
    matcher = grammar.matcher()
    tokens: list[int] = []
    for step in range(MAX_WALK_TOKENS):
        if matcher.is_terminated():
            break
        allowed = allowed_tokens(backend, matcher)
        assert allowed, "the mask allows nothing"
        assert max(allowed) < TOKENIZER_SIZE, "an id past the tokenizer was allowed"
        assert bool(set(allowed) & backend.eos_token_ids) == matcher.is_accepting()
        token = _pick(rng, backend, allowed, step)
        assert matcher.accept_tokens([token])
        if token in backend.eos_token_ids:
            assert matcher.is_terminated()
            break
        tokens.append(token)
    else:
        pytest.fail(f"walk did not end in {MAX_WALK_TOKENS} tokens: {decode(backend, tokens)!r}")
    return decode(backend, tokens)


SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "nick": {"type": "string", "maxLength": 4},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", 3, None, {"a": 1}]},
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "integer_range": {"type": "integer", "minimum": 10, "maximum": 99},
    "string_pattern": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"},
    "any_of": {
        "anyOf": [
            {"type": "string", "maxLength": 5},
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "boolean"},
        ]
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 3,
    },
    # llguidance implements patternProperties: keys matching a pattern take its schema, others are refused.
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^n_[a-z]{1,3}$": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_walks_produce_valid_json(backend, name):
    grammar = compile_(backend, json=SCHEMAS[name])
    for seed in range(3):
        text = random_walk(backend, grammar, seed)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_walks_produce_objects(backend):
    grammar = compile_(backend, json_object=True)
    for seed in range(3):
        assert isinstance(json.loads(random_walk(backend, grammar, seed)), dict)


def test_regex_walks_match(backend):
    pattern = r"(ab|cd){1,3}x?[0-9]{2}"
    grammar = compile_(backend, regex=pattern)
    for seed in range(5):
        assert re.fullmatch(pattern, random_walk(backend, grammar, seed))


def test_choice_walks_pick_a_choice(backend):
    choices = ["yes", "no", "maybe so", "🙂 ok", 'quote " and \\ backslash']
    grammar = compile_(backend, choice=choices)
    seen = {random_walk(backend, grammar, seed) for seed in range(12)}
    assert seen <= set(choices)
    assert len(seen) > 1


def _is_sum(text: str) -> bool:
    """text is `term (("+" | "-") term)*` with term = 1-3 digits or a parenthesised sum."""
    while True:  # replace innermost parenthesised sums by a number until none is left
        reduced = re.sub(r"\(([0-9]{1,3}[+-])*[0-9]{1,3}\)", "0", text)
        if reduced == text:
            return re.fullmatch(r"([0-9]{1,3}[+-])*[0-9]{1,3}", text) is not None
        text = reduced


def test_lark_grammar_walks_match(backend):
    grammar = compile_(backend, grammar='start: term (("+" | "-") term)*\nterm: /[0-9]{1,3}/ | "(" start ")"')
    texts = [random_walk(backend, grammar, seed) for seed in range(5)]
    assert all(_is_sum(text) for text in texts), texts
    assert any("(" in text for text in texts)


# --------------------------------------------------------------------------------------------------
# EOS, termination, rollback
# --------------------------------------------------------------------------------------------------


def test_eos_allowed_only_where_the_grammar_may_end(backend, tokenizer):
    eos = tokenizer.eos_token_id
    matcher = compile_(backend, choice=["ab", "abc"]).matcher()
    assert eos not in allowed_tokens(backend, matcher) and not matcher.is_accepting()
    advance_text(backend, matcher, "ab")
    allowed = allowed_tokens(backend, matcher)
    assert eos in allowed and len(allowed) > 1  # "ab" may end here, or go on to "abc"
    assert matcher.is_accepting() and not matcher.is_terminated()
    advance_text(backend, matcher, "c")
    assert matcher.is_terminated()
    assert allowed_tokens(backend, matcher) == [eos]


def test_eos_masked_inside_json_until_it_closes(backend, tokenizer):
    eos = tokenizer.eos_token_id
    matcher = compile_(backend, json={"type": "object", "properties": {"a": {"type": "integer"}}}).matcher()
    for prefix in ("{", '"a"', ":", " 1"):
        assert eos not in allowed_tokens(backend, matcher), prefix
        advance_text(backend, matcher, prefix)
    assert eos not in allowed_tokens(backend, matcher)  # the integer may go on, the object must close
    advance_text(backend, matcher, "}")
    assert matcher.is_accepting()
    assert eos in allowed_tokens(backend, matcher)


def test_every_eos_id_is_allowed_where_the_grammar_may_end(tmp_path):
    make_tokenizer(tmp_path, vocab_size=512)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    eos_ids = [hf_tokenizer.convert_tokens_to_ids("</s>"), hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    backend = LLGuidanceBackend(hf_tokenizer, vocab_size=512, eos_token_ids=eos_ids)
    matcher = compile_(backend, regex="[0-9]+").matcher()
    assert not set(eos_ids) & set(allowed_tokens(backend, matcher))
    advance_text(backend, matcher, "42")
    assert set(eos_ids) <= set(allowed_tokens(backend, matcher))
    assert matcher.accept_tokens([eos_ids[1]]) and matcher.is_terminated()


def test_ids_past_the_tokenizer_are_never_allowed(backend):
    matcher = compile_(backend, regex="(.|\n)*").matcher()  # anything at all
    bitmask = allocate_bitmask(1, backend.vocab_size)  # every bit set, padding included
    matcher.fill_bitmask(bitmask, 0)
    bits = unpack_bitmask(bitmask, bitmask_width(backend.vocab_size) * 32)[0]
    assert bits[:TOKENIZER_SIZE].any()
    assert not bits[TOKENIZER_SIZE:].any()


def test_rejected_token_leaves_the_state_unchanged(backend, tokenizer):
    matcher = compile_(backend, json=SCHEMAS["required_fields"]).matcher()
    advance_text(backend, matcher, '{"name": "x')
    before = allowed_tokens(backend, matcher)
    rejected = next(token for token in range(TOKENIZER_SIZE) if token not in before)
    valid = before[0]
    assert matcher.validate_tokens([valid, rejected]) == 1
    assert not matcher.accept_tokens([valid, rejected])  # all or none
    assert allowed_tokens(backend, matcher) == before
    assert matcher.num_accepted_tokens == len(backend.llg_tokenizer.tokenize_str('{"name": "x'))


def test_ids_outside_the_vocabulary_are_rejected_not_fatal(backend):
    matcher = compile_(backend, regex="(.|\n)*").matcher()
    for token in (TOKENIZER_SIZE, MODEL_VOCAB - 1, MODEL_VOCAB, 10**6, -1):  # past the tokenizer, past the model
        assert matcher.validate_tokens([token]) == 0
        assert not matcher.accept_tokens([token])
    advance_text(backend, matcher, "still fine")


def test_rollback_restores_the_mask(backend):
    grammar = compile_(backend, json=SCHEMAS["ref"])
    rng = random.Random(7)
    matcher = grammar.matcher()
    masks, accepted = [], 0
    while accepted < 12 and not matcher.is_terminated():
        masks.append(allowed_tokens(backend, matcher))
        token = _pick(rng, backend, [t for t in masks[-1] if t not in backend.eos_token_ids], accepted + 20)
        assert matcher.accept_tokens([token])
        accepted += 1
    for back in (1, 3, accepted - 4):
        matcher.rollback(back)
        accepted -= back
        assert allowed_tokens(backend, matcher) == masks[accepted]
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(accepted + 1)
    assert allowed_tokens(backend, matcher) == masks[accepted]  # a refused rollback breaks nothing


def test_eos_after_the_end_is_accepted_and_can_be_rolled_back(backend, tokenizer):
    eos = tokenizer.eos_token_id
    matcher = compile_(backend, choice=["12"]).matcher()
    digits = backend.llg_tokenizer.tokenize_str("12")
    assert len(digits) == 2  # the demo tokenizer splits numbers into digits
    assert matcher.validate_tokens([*digits, eos, eos, digits[0]]) == len(digits) + 2  # what accept_tokens takes
    assert matcher.num_accepted_tokens == 0
    advance_text(backend, matcher, "12")
    assert matcher.is_terminated()
    accepted = matcher.num_accepted_tokens
    assert matcher.validate_tokens([eos, eos]) == 2
    assert matcher.accept_tokens([eos, eos])  # an engine sampling past the end hands these back
    assert not matcher.accept_tokens([digits[0]])
    matcher.rollback(accepted + 1)  # both EOS and all but one text token
    assert matcher.num_accepted_tokens == 1
    assert not matcher.is_terminated()


# --------------------------------------------------------------------------------------------------
# Compilation: cache, errors
# --------------------------------------------------------------------------------------------------


def test_compile_cache_returns_the_same_grammar(backend):
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}}
    first = compile_(backend, json=schema)
    assert compile_(backend, json=json.dumps(schema, indent=2)) is first  # same key: dict or its JSON text
    assert compile_(backend, json={"properties": {"k": {"type": "boolean"}}, "type": "object"}) is not first
    assert first.matcher() is not first.matcher()


def test_property_order_is_part_of_the_constraint(backend):
    """Schemas differing only in key order get different grammars: the output follows the schema's order."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    for order in (["b", "a"], ["a", "b"]):
        schema = {"type": "object", "properties": {key: digit for key in order}, "required": order,
                  "additionalProperties": False}
        text = random_walk(backend, compile_(backend, json=schema), seed=0)
        assert list(json.loads(text)) == order


def test_concurrent_compiles_share_one_grammar(tokenizer):
    backend = LLGuidanceBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[2])
    params = StructuredOutputsParams(json=SCHEMAS["ref"])
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        grammars = list(pool.map(backend.compile, [params] * 8))
    assert all(grammar is grammars[0] for grammar in grammars)


def test_compile_cache_is_bounded_lru(tokenizer):
    backend = LLGuidanceBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[2], cache_size=2)
    a, b = compile_(backend, regex="a"), compile_(backend, regex="b")
    assert compile_(backend, regex="a") is a  # refreshes "a": "b" is now the stalest
    compile_(backend, regex="c")
    assert compile_(backend, regex="a") is a
    assert compile_(backend, regex="b") is not b


def test_compile_cache_is_bounded_by_constraint_text(tokenizer):
    """Memory grows with a grammar's text: the cache keeps at most cache_chars of it, and a constraint longer
    than that on its own is compiled for each request, never kept."""
    backend = LLGuidanceBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[2],
                                limits=GrammarLimits(cache_chars=10))
    short, other = compile_(backend, regex="a" * 6), compile_(backend, regex="b" * 4)  # 10 characters: both kept
    assert compile_(backend, regex="a" * 6) is short and compile_(backend, regex="b" * 4) is other
    compile_(backend, regex="c" * 3)  # 13 characters: the stalest ("a" * 6) goes
    assert compile_(backend, regex="b" * 4) is other
    assert compile_(backend, regex="a" * 6) is not short
    long = compile_(backend, regex="d" * 11)
    assert compile_(backend, regex="d" * 11) is not long


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "nonsense"}}, "Invalid type"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum"),
        ({"json": {"$ref": "#/$defs/missing"}}, "does not exist"),
        ({"json": {"type": "string", "pattern": "[a-"}}, "unclosed character class"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": {"not": {"type": "string"}}}, "not"),
        ({"json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, "if"),
        ({"json": {"type": "object", "propertyNames": {"maxLength": 3}}}, "propertyNames"),
        ({"json": {"type": "string", "format": "no-such-format"}}, "Unknown format"),
        # A schema's own llguidance options cannot make unsupported keywords pass silently.
        ({"json": {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}}, "uniqueItems"),
        (
            {"json": {"x-guidance": {"coerce_one_of": True}, "oneOf": [{"type": "object"}, {"required": ["a"]}]}},
            "oneOf",
        ),
        ({"json": {"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}}, "oneOf"),
        ({"regex": "[a-"}, "unclosed character class"),
        ({"regex": "(?=lookahead)"}, "look-around"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"grammar": "this is not lark"}, "Expected"),
        # Text that looks like llguidance's own JSON grammar format is still read as Lark.
        ({"grammar": '{"grammars": []}'}, "expecting rule"),
    ],
)
def test_compile_errors_name_the_param(backend, constraint, message):
    (kind,) = constraint
    with pytest.raises(InvalidConstraint, match=re.escape(message)) as raised:
        backend.compile(StructuredOutputsParams(**constraint))
    assert raised.value.param == f"structured_outputs.{kind}"


def test_failed_compile_is_cached_and_names_the_current_param(backend):
    constraint = {"json": {"type": "array", "contains": {"type": "integer"}}}
    for error_param in (None, "response_format", None):
        with pytest.raises(InvalidConstraint, match="contains") as raised:
            backend.compile(StructuredOutputsParams(**constraint, error_param=error_param))
        assert raised.value.param == (error_param or "structured_outputs.json")


def test_compile_timeout(tokenizer, monkeypatch):
    backend = LLGuidanceBackend(tokenizer, vocab_size=MODEL_VOCAB, eos_token_ids=[2],
                                limits=GrammarLimits(compile_timeout_s=0.05))
    release = threading.Event()
    real_compile = LLGuidanceBackend._compile

    def stuck_compile(self, params):
        release.wait()
        return real_compile(self, params)

    monkeypatch.setattr(LLGuidanceBackend, "_compile", stuck_compile)
    with pytest.raises(InvalidConstraint, match="took longer than 0.05 s") as raised:
        compile_(backend, regex="a+")
    assert raised.value.param == "structured_outputs.regex"
    release.set()
    monkeypatch.setattr(LLGuidanceBackend, "_compile", real_compile)
    assert compile_(backend, regex="a+").key == ("regex", "a+")  # a timeout is not cached as a failure


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "param", "message"),
    [
        ({}, "structured_outputs", "got none"),
        ({"json_object": False}, "structured_outputs", "got none"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "got regex, choice"),
        ({"json": {}, "json_object": True}, "structured_outputs", "got json, json_object"),
        ({"json": [1, 2]}, "structured_outputs.json", "must be a JSON object"),
        ({"json": 3}, "structured_outputs.json", "must be a JSON object"),
        ({"json": "[1]"}, "structured_outputs.json", "must be a JSON object"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": {"const": float("nan")}}, "structured_outputs.json", "cannot be written as JSON"),
        ({"json_object": "yes"}, "structured_outputs.json_object", "must be a boolean"),
        ({"regex": 5}, "structured_outputs.regex", "must be a string"),
        ({"regex": ""}, "structured_outputs.regex", "must not be empty"),
        ({"choice": "yes"}, "structured_outputs.choice", "list of strings"),
        ({"choice": ["a", 2]}, "structured_outputs.choice", "item 1 is int"),
        ({"choice": []}, "structured_outputs.choice", "at least one"),
        ({"grammar": b"start: x"}, "structured_outputs.grammar", "must be a string"),
        ({"grammar": "  \n"}, "structured_outputs.grammar", "must not be empty"),
    ],
)
def test_params_validation(constraint, param, message):
    with pytest.raises(InvalidConstraint, match=re.escape(message)) as raised:
        StructuredOutputsParams(**constraint)
    assert raised.value.param == param


def test_params_error_param_overrides_every_name():
    for constraint in ({}, {"json": 3}, {"choice": []}):
        with pytest.raises(InvalidConstraint) as raised:
            StructuredOutputsParams(**constraint, error_param="response_format")
        assert raised.value.param == "response_format"


def test_params_are_frozen_and_keyed_by_content():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    params = StructuredOutputsParams(json=schema)
    assert params.kind == "json"
    assert params.cache_key() == StructuredOutputsParams(json=json.dumps(schema, indent=4)).cache_key()
    assert params.cache_key() == StructuredOutputsParams(json=schema, error_param="response_format").cache_key()
    schema["type"] = "array"  # the caller's dict changes later; the key computed at construction does not
    assert params.cache_key() == ("json", '{"type":"object","properties":{"a":{"type":"string"}}}')
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.regex = "a"  # type: ignore[misc]
    choice = StructuredOutputsParams(choice=["a", "b"])
    assert choice.choice == ("a", "b") and choice.cache_key() == ("choice", '["a", "b"]')
    assert hash(choice) == hash(StructuredOutputsParams(choice=("a", "b")))
    assert StructuredOutputsParams(json_object=True).cache_key() == ("json_object", "")


# --------------------------------------------------------------------------------------------------
# Bitmasks
# --------------------------------------------------------------------------------------------------


def test_fill_bitmask_checks_its_target(backend):
    matcher = compile_(backend, regex="a").matcher()
    width = bitmask_width(backend.vocab_size)
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(torch.zeros(1, width, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="contiguous words"):
        matcher.fill_bitmask(torch.zeros(1, width + 1, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="contiguous words"):
        matcher.fill_bitmask(torch.zeros(width, 2, dtype=torch.int32).t(), 0)
    with pytest.raises(IndexError):
        matcher.fill_bitmask(allocate_bitmask(2, backend.vocab_size), 2)


def test_fill_bitmasks_in_parallel_matches_one_by_one(backend):
    grammars = [compile_(backend, json=SCHEMAS[name]) for name in ("enum", "ref", "any_of")]
    matchers = [grammar.matcher() for grammar in grammars]
    advance_text(backend, matchers[1], '[{"x": 1')
    one_by_one = allocate_bitmask(4, backend.vocab_size)
    for row, matcher in zip((3, 0, 1), matchers):
        matcher.fill_bitmask(one_by_one, row)
    parallel = allocate_bitmask(4, backend.vocab_size)
    backend.fill_bitmasks(list(zip(matchers, (3, 0, 1))), parallel)
    assert torch.equal(parallel, one_by_one)
    assert (parallel[2] == -1).all()  # a row nobody asked for is untouched


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    for row in rows:
        for token in range(logits.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


def test_apply_bitmask_masks_constrained_rows_only():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, MODEL_VOCAB, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31, (4, bitmask_width(MODEL_VOCAB)), dtype=torch.int32, generator=generator)
    bitmask[0, 0] = -(2**31)  # only the sign bit: token 31 alone in the first word
    for rows in ([0, 2], [3], None):
        masked = logits.clone()
        apply_bitmask(masked, bitmask, rows)
        expected_rows = list(range(4)) if rows is None else rows
        assert torch.equal(masked, _reference_mask(logits, bitmask, expected_rows))
    masked = logits.clone()
    apply_bitmask(masked, bitmask, [0])
    assert torch.isinf(masked[0, :31]).all() and masked[0, 31] == logits[0, 31]


def test_apply_bitmask_edge_cases():
    logits = torch.randn(2, 64)
    unchanged = logits.clone()
    apply_bitmask(logits, allocate_bitmask(2, 64), [])
    assert torch.equal(logits, unchanged)
    apply_bitmask(logits, allocate_bitmask(2, 64), None)  # all allowed
    assert torch.equal(logits, unchanged)
    with pytest.raises(ValueError, match="covers 32 tokens"):
        apply_bitmask(logits, allocate_bitmask(2, 32), None)
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int64), None)


def test_masked_sampling_follows_the_grammar(backend):
    """End to end on fake logits: mask, argmax, accept, until the grammar ends."""
    grammar = compile_(backend, json=SCHEMAS["integer_range"])
    matcher = grammar.matcher()
    generator = torch.Generator().manual_seed(3)
    bitmask = allocate_bitmask(2, backend.vocab_size)
    tokens: list[int] = []
    while not matcher.is_terminated():
        logits = torch.randn(2, MODEL_VOCAB, generator=generator)
        matcher.fill_bitmask(bitmask, 1)
        apply_bitmask(logits, bitmask, [1])
        token = int(logits[1].argmax())
        assert matcher.accept_tokens([token])
        if token not in backend.eos_token_ids:
            tokens.append(token)
    assert 10 <= json.loads(decode(backend, tokens)) <= 99


def test_broken_matcher_raises(backend):
    healthy, broken = compile_(backend, regex="a+").matcher(), compile_(backend, regex="a+").matcher()
    # Force llguidance's error state the only way its API allows: consume a disallowed token directly.
    broken.llmatcher.consume_token(backend.llg_tokenizer.tokenize_str("b")[0])
    bitmask = allocate_bitmask(2, backend.vocab_size)
    with pytest.raises(GrammarStateError, match="doesn't satisfy the grammar"):
        broken.fill_bitmask(bitmask, 0)
    with pytest.raises(GrammarStateError):
        broken.is_terminated()
    with pytest.raises(GrammarStateError) as raised:
        backend.fill_bitmasks([(healthy, 0), (broken, 1)], bitmask)
    assert raised.value.rows == (1,)
    assert (
        allowed_tokens(backend, healthy) == unpack_bitmask(bitmask, backend.vocab_size)[0].nonzero().flatten().tolist()
    )
