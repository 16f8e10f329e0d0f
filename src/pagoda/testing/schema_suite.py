"""A suite of output constraints (JSON schemas, regexes, choice lists) and how to check an output against one.

One source for the structured-output validity tests and the structured-output benchmark. Every case
states `max_tokens`: strings and arrays are bounded so that a sample, even a random walk over the allowed
tokens (a random-weight model, temperature 1), ends well within it on the test tokenizers.

Formats are checked with `jsonschema`'s Draft 2020-12 format checker. Only formats that llguidance compiles
exactly and that checker checks without extra packages are used (FORMATS). Left out: "date" (llguidance
allows February 29 in every year, `datetime.date` does not), "time", "date-time", "hostname",
"duration" and "uri" (jsonschema checks them only with optional packages).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)

from pagoda.structured import StructuredOutputsParams

FORMATS = ("email", "uuid", "ipv4", "ipv6")


class InvalidOutput(ValueError):
    """An output that does not satisfy its case's constraint."""


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    max_tokens: int

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema)

    def check(self, text: str) -> None:
        """Raises InvalidOutput unless `text` is a JSON instance of the schema (formats checked)."""
        validator_cls = jsonschema.Draft202012Validator
        try:
            validator_cls(self.schema, format_checker=validator_cls.FORMAT_CHECKER).validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError) as error:
            raise InvalidOutput(f"{text!r}: {str(error).splitlines()[0]}") from error


@dataclass(frozen=True)
class RegexCase:
    name: str
    pattern: str  # the common subset of Rust's and Python's regex syntax
    max_tokens: int

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(regex=self.pattern)

    def check(self, text: str) -> None:
        if re.fullmatch(self.pattern, text) is None:
            raise InvalidOutput(f"{text!r} does not match {self.pattern!r}")


@dataclass(frozen=True)
class ChoiceCase:
    name: str
    choices: tuple[str, ...]
    max_tokens: int

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(choice=self.choices)

    def check(self, text: str) -> None:
        if text not in self.choices:
            raise InvalidOutput(f"{text!r} is not one of {self.choices}")


Case = SchemaCase | RegexCase | ChoiceCase


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """A closed object: no properties beyond `properties`; all of them required unless `required` says."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _string(max_length: int, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


_POINT = _object({"x": _integer(-9, 9), "y": _integer(-9, 9)})

SCHEMAS: tuple[SchemaCase, ...] = (
    # Objects: required, optional and nested fields.
    SchemaCase("required_fields", _object({"name": _string(8), "age": _integer(0, 120)}), 128),
    SchemaCase(
        "optional_fields",
        _object({"title": _string(6), "done": {"type": "boolean"}, "rank": _integer(1, 5)}, required=["title"]),
        128,
    ),
    SchemaCase(
        "nested_object",
        _object(
            {
                "user": _object(
                    {"id": _integer(1, 999), "profile": _object({"nick": _string(5), "admin": {"type": "boolean"}})}
                )
            }
        ),
        224,
    ),
    SchemaCase("deep_nesting", _object({"a": _object({"b": _object({"c": _object({"d": _integer(0, 9)})})})}), 192),
    SchemaCase("empty_object", _object({}), 32),
    # Arrays: item counts bounded or fixed, tuples, arrays of arrays and of objects.
    SchemaCase("int_array", {"type": "array", "items": _integer(-5, 5), "minItems": 2, "maxItems": 4}, 64),
    SchemaCase("string_array", {"type": "array", "items": _string(5), "minItems": 1, "maxItems": 3}, 96),
    SchemaCase("fixed_length_array", {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}, 80),
    SchemaCase("object_array", {"type": "array", "items": _POINT, "maxItems": 3}, 256),
    SchemaCase(
        "matrix",
        {
            "type": "array",
            "items": {"type": "array", "items": _integer(0, 9), "minItems": 2, "maxItems": 2},
            "minItems": 2,
            "maxItems": 2,
        },
        128,
    ),
    SchemaCase(
        "tuple",
        {
            "type": "array",
            "prefixItems": [_string(4), _integer(0, 99), {"type": "boolean"}],
            "items": False,
            "minItems": 3,
        },
        96,
    ),
    # Enums and constants.
    SchemaCase("string_enum", {"enum": ["red", "green", "blue", "light blue"]}, 24),
    SchemaCase("mixed_enum", {"enum": ["a", 1, None, True, {"k": [1, 2]}]}, 64),
    SchemaCase(
        "const_fields", _object({"version": {"const": 2}, "kind": {"const": "point"}, "x": _integer(0, 9)}), 160
    ),
    # Numbers: integer vs number, inclusive and exclusive bounds.
    SchemaCase("integer_range", _integer(10, 99), 8),
    SchemaCase("negative_integer_range", _integer(-1000, -10), 8),
    SchemaCase("exclusive_integer", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, 8),
    SchemaCase("number_range", {"type": "number", "minimum": -1.5, "maximum": 2.5}, 64),
    SchemaCase("exclusive_number", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 64),
    SchemaCase(
        "integer_and_number",
        _object({"count": _integer(0, 1000), "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
        128,
    ),
    SchemaCase("multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}, 8),
    # Strings: lengths, patterns, formats.
    SchemaCase("string_length", _string(6, minLength=2), 24),
    SchemaCase("string_pattern", {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"}, 24),
    SchemaCase("format_email", _string(24, format="email"), 40),
    SchemaCase("format_uuid", {"type": "string", "format": "uuid"}, 80),
    SchemaCase("format_ipv4", {"type": "string", "format": "ipv4"}, 32),
    SchemaCase("format_ipv6", {"type": "string", "format": "ipv6"}, 80),
    # Booleans, null, unions.
    SchemaCase(
        "booleans", _object({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}), 128
    ),
    SchemaCase("null", {"type": "null"}, 8),
    SchemaCase(
        "nullable",
        _object(
            {
                "note": {"type": ["string", "null"], "maxLength": 6},
                "n": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            }
        ),
        128,
    ),
    SchemaCase("any_of_scalars", {"anyOf": [_string(5), _integer(0, 9), {"type": "boolean"}]}, 16),
    SchemaCase(
        "any_of_objects",
        {
            "anyOf": [
                _object({"kind": {"const": "circle"}, "r": _integer(1, 9)}),
                _object({"kind": {"const": "rect"}, "w": _integer(1, 9), "h": _integer(1, 9)}),
            ]
        },
        144,
    ),
    SchemaCase(
        "all_of",
        {"allOf": [_object({"a": _integer(0, 9), "b": {"type": "boolean"}}, required=["a"]), {"required": ["b"]}]},
        96,
    ),
    # References.
    SchemaCase(
        "ref_defs",
        {"$defs": {"point": _POINT}, "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
        256,
    ),
    SchemaCase(
        "ref_chain",
        {
            "$defs": {
                "city": _object({"name": _string(6), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
                "address": _object({"city": {"$ref": "#/$defs/city"}, "street": _string(8)}),
            },
            "$ref": "#/$defs/address",
        },
        224,
    ),
    # Open property sets.
    SchemaCase(
        "pattern_properties",
        {
            "type": "object",
            "patternProperties": {"^n_[a-z]{1,3}$": _integer(0, 9)},
            "additionalProperties": False,
            "maxProperties": 3,
        },
        96,
    ),
)

REGEXES: tuple[RegexCase, ...] = (
    RegexCase("phone", r"[0-9]{3}-[0-9]{4}", 16),
    RegexCase("hex_color", r"#[0-9a-f]{6}", 16),
    RegexCase("dotted_quad", r"[0-9]{1,3}(\.[0-9]{1,3}){3}", 32),
    RegexCase("capitalized_words", r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}", 32),
    RegexCase("alternation", r"(ab|cd){1,3}x?[0-9]{2}", 16),
)

CHOICES: tuple[ChoiceCase, ...] = (
    ChoiceCase("yes_no", ("yes", "no"), 8),
    ChoiceCase("sentiment", ("positive", "negative", "neutral"), 16),
    ChoiceCase("shared_prefixes", ("blue", "light blue", "light", "blueberry"), 16),
    ChoiceCase("non_ascii", ("🙂", "café", "naïve"), 16),
)

ALL_CASES: tuple[Case, ...] = SCHEMAS + REGEXES + CHOICES


def case(name: str) -> Case:
    """The case called `name`."""
    for candidate in ALL_CASES:
        if candidate.name == name:
            return candidate
    raise KeyError(name)
