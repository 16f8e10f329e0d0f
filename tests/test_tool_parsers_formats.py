"""The `mistral` and `pythonic` tool-call parsers: whole outputs, and streams cut at every character.

A stream reads the text as it grows; what it sends is the growth of each reading (content appended, calls
appended), so every reading must extend the one before, and the last must equal the whole output's reading.
`stream_readings` checks that at every prefix, which covers the awkward cuts (inside the marker, inside a string
argument, between calls); the tests then look at those cuts by name.
"""

from __future__ import annotations

import json

import pytest

from pagoda.sampling import SamplingParams
from pagoda.server.tool_parsers import TOOL_CALL_PARSERS, MistralParser, PythonicParser
from pagoda.server.tool_parsers.base import ParsedOutput
from pagoda.server.tools import ToolCallReader


def calls_of(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def stream_readings(parser, text: str) -> list[ParsedOutput]:
    """The parser's reading of every prefix of `text` (the last one finished), checked to only grow."""
    readings = [parser.parse(text[:end], finished=False) for end in range(len(text) + 1)]
    readings.append(parser.parse(text, finished=True))
    for before, after in zip(readings, readings[1:]):
        assert after.content.startswith(before.content), (before, after)
        assert calls_of(after)[: len(before.tool_calls)] == calls_of(before), (before, after)
    whole = parser.parse(text, finished=True)
    assert (readings[-1].content, calls_of(readings[-1])) == (whole.content, calls_of(whole))
    return readings


def at_cut(parser, text: str, cut: str) -> ParsedOutput:
    """The unfinished reading of `text` up to (not including) the first `cut`."""
    return parser.parse(text[: text.index(cut)], finished=False)


# --- mistral ------------------------------------------------------------------------------------------------

NEWER = 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo (NO)"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
OLDER = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", "arguments": {"a": 1}}]'


def test_mistral_newer_form_reads_each_call_and_keeps_the_text_before_as_content():
    parsed = MistralParser().parse(NEWER, finished=True)
    assert parsed.content == "Let me check. "
    assert calls_of(parsed) == [("get_weather", {"city": "Oslo (NO)"}), ("add", {"a": 1, "b": 2})]
    assert len({call.id for call in parsed.tool_calls}) == 2
    # [ARGS] is optional, and a call id after the name is not part of it
    bare = MistralParser().parse('[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]mul[CALL_ID]a1B2c3D4e[ARGS]{"x": 2}', True)
    assert bare.content == "" and calls_of(bare) == [("add", {"a": 1}), ("mul", {"x": 2})]


def test_mistral_older_form_reads_a_json_list_or_one_object():
    parsed = MistralParser().parse(OLDER, finished=True)
    assert parsed.content == "" and calls_of(parsed) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    one = MistralParser().parse('[TOOL_CALLS]{"name": "add", "arguments": {"a": 1}}', finished=True)
    assert calls_of(one) == [("add", {"a": 1})]


@pytest.mark.parametrize("text", [NEWER, OLDER])
def test_mistral_streams_each_call_once_complete_and_holds_back_a_marker_being_written(text):
    readings = stream_readings(MistralParser(), text)
    assert [len(r.tool_calls) for r in readings][-1] == 2
    parser = MistralParser()
    inside_marker = parser.parse(text[: text.index("[TOOL_CALLS]") + 5], finished=False)  # "...[TOOL"
    assert inside_marker.content == text[: text.index("[TOOL_CALLS]")] and not inside_marker.tool_calls
    inside_string = at_cut(parser, text, 'slo')  # the first call's city half written
    assert not inside_string.tool_calls
    first_done = at_cut(parser, text, "add")  # the first call complete, the second not started
    assert calls_of(first_done) == [("get_weather", {"city": "Oslo (NO)" if text is NEWER else "Oslo"})]


def test_mistral_text_without_the_marker_is_content_and_streams_as_it_comes():
    text = "The weather in Oslo is fine [really]."
    readings = stream_readings(MistralParser(), text)
    assert readings[-1].content == text and not readings[-1].tool_calls
    assert MistralParser().parse("fine [TOOL", finished=False).content == "fine "
    assert MistralParser().parse("fine [", finished=True).content == "fine ["


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]get weather{"city": "Oslo"}',  # not a function name
    '[TOOL_CALLS]add[ARGS]{"a": 1',  # cut short (max_tokens)
    '[TOOL_CALLS]add[ARGS][1, 2]',  # arguments not an object
    '[TOOL_CALLS] [{"function": "add"}]',  # not a call
    '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}',
])
def test_mistral_first_call_not_well_formed_leaves_the_whole_output_as_content(text):
    readings = stream_readings(MistralParser(), text)
    assert readings[-1].content == text and readings[-1].tool_calls == []


def test_mistral_calls_before_a_bad_one_stand_and_the_rest_is_content():
    text = 'Sure.[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]oops{"a": '
    readings = stream_readings(MistralParser(), text)
    assert calls_of(readings[-1]) == [("add", {"a": 1})]
    assert readings[-1].content == 'Sure.[TOOL_CALLS]oops{"a": '
    listed = MistralParser().parse('[TOOL_CALLS][{"name": "add", "arguments": {}}, 7]', finished=True)
    assert calls_of(listed) == [("add", {})] and listed.content == "7]"
    trailing = MistralParser().parse('[TOOL_CALLS]add{"a": 1} and that is all', finished=True)
    assert calls_of(trailing) == [("add", {"a": 1})] and trailing.content == "and that is all"


def test_mistral_keeps_special_tokens_in_the_text_it_reads():
    params = SamplingParams(max_tokens=4)
    assert ToolCallReader.auto("mistral").sampling_params(params).skip_special_tokens is False
    assert ToolCallReader.auto("hermes").sampling_params(params).skip_special_tokens is True
    assert params.skip_special_tokens is True


# --- pythonic -----------------------------------------------------------------------------------------------

PYTHONIC = '[get_weather(city="Oslo (NO), \\"north\\"]"), add(a=1, b=-2.5, tags=[\'x\', None], opts={"k": True})]'


def test_pythonic_reads_every_call_of_the_list_with_literal_arguments_as_json():
    parsed = PythonicParser().parse(PYTHONIC, finished=True)
    assert parsed.content == ""
    assert calls_of(parsed) == [("get_weather", {"city": 'Oslo (NO), "north"]'}),
                                ("add", {"a": 1, "b": -2.5, "tags": ["x", None], "opts": {"k": True}})]
    assert json.loads(parsed.tool_calls[1].arguments)["opts"] == {"k": True}
    assert calls_of(PythonicParser().parse("  [ping()]\n", finished=True)) == [("ping", {})]


def test_pythonic_streams_each_call_once_its_parenthesis_closes():
    readings = stream_readings(PythonicParser(), PYTHONIC)
    assert readings[-1].content == "" and len(readings[-1].tool_calls) == 2
    parser = PythonicParser()
    inside_string = at_cut(parser, PYTHONIC, "north")  # inside the string, after its ")" and "]"
    assert inside_string.content == "" and not inside_string.tool_calls
    first_done = at_cut(parser, PYTHONIC, " add(")
    assert [c.name for c in first_done.tool_calls] == ["get_weather"] and first_done.content == ""


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "[1, 2, 3] are numbers",
    "[Note: no tools needed]",
    '[get_weather("Oslo")]',  # positional arguments have no names
    "[add(a=1 + 2)]",  # not a literal
    "[os.system(cmd='ls')]",  # not a plain function name
    "[add(**kwargs)]",
    "[]",
    "[add(a=1",  # cut short (max_tokens)
])
def test_pythonic_output_that_is_not_a_list_of_calls_is_content(text):
    readings = stream_readings(PythonicParser(), text)
    assert readings[-1].content == text and readings[-1].tool_calls == []


def test_pythonic_releases_plain_text_at_once_and_keeps_calls_before_a_bad_one():
    assert PythonicParser().parse("[Note", finished=False).content == ""  # could still be a call named Note
    assert PythonicParser().parse("[Note:", finished=False).content == "[Note:"
    mixed = PythonicParser().parse("[add(a=1), 3]", finished=True)
    assert calls_of(mixed) == [("add", {"a": 1})] and mixed.content == "3]"
    after = PythonicParser().parse("[add(a=1)]\nDone.", finished=True)
    assert calls_of(after) == [("add", {"a": 1})] and after.content == "Done."


def test_every_named_parser_is_registered():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
