"""Tool-call parsers and forced-call grammars: the model's text in, OpenAI's tool_calls out."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda.server.tool_parsers import HermesParser, Llama3JsonParser
from pagoda.wire.tool_calls import forced_calls, forced_constraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_hermes_parses_calls_and_keeps_the_text_before_them_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    parsed = HermesParser().parse(text, finished=True)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_streaming_holds_back_a_tag_being_written_and_waits_for_the_closing_tag():
    parser = HermesParser()
    assert parser.parse("Sure <tool_", finished=False).content == "Sure "
    partial = parser.parse('Sure <tool_call>{"name": "add", "argum', finished=False)
    assert partial.content == "Sure" and partial.tool_calls == []
    done = parser.parse('Sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', finished=False)
    assert [c.name for c in done.tool_calls] == ["add"]


def test_hermes_accepts_a_last_call_without_its_closing_tag_at_the_end_and_falls_back_to_text_when_malformed():
    parsed = HermesParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', finished=True)
    assert [c.name for c in parsed.tool_calls] == ["add"]
    broken = '<tool_call>{"name": add}</tool_call>'
    parsed = HermesParser().parse(broken, finished=True)
    assert parsed.tool_calls == [] and parsed.content == broken


def test_llama3_json_parses_one_or_several_calls_and_leaves_plain_text_alone():
    one = Llama3JsonParser().parse('{"name": "add", "parameters": {"a": 1, "b": 2}}', finished=True)
    assert [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == [("add", {"a": 1, "b": 2})]
    two = Llama3JsonParser().parse('{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                   '{"name": "get_weather", "parameters": {"city": "Rome"}}', finished=True)
    assert [c.name for c in two.tool_calls] == ["add", "get_weather"]
    assert Llama3JsonParser().parse("The answer is 3.", finished=True).content == "The answer is 3."
    assert Llama3JsonParser().parse('{"name": "add", "param', finished=False).content == ""


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_grammar_accepts_exactly_the_calls_of_the_given_functions(parallel):
    schema = forced_constraint([WEATHER, ADD], "required", parallel).json
    assert isinstance(schema, dict)
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "add", "parameters": {"a": "x", "b": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    two = good + [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    calls = forced_calls(json.dumps(two), "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                                   ("get_weather", {"city": "Oslo"})]


def test_a_named_function_is_forced_through_its_own_parameter_schema():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_constraint([WEATHER, ADD], choice, True).json == WEATHER["function"]["parameters"]
    calls = forced_calls('{"city": "Lima"}', choice)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Lima"}')]
    assert forced_calls('{"city": "Li', choice) == []  # cut by max_tokens: no call
