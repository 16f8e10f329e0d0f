"""Tool calling over HTTP with the official client: forced calls, the model's own calls, streamed deltas.

The server runs the built-in model as `make serve` does: no tool flags, so its hermes parser is on by
default. Forced calls (`required`, a named function) hold for any model, since a grammar writes them. For
`auto`, the model's own hermes text is parsed; a regex constraint makes the model write a known call, so
that the parsing and the streamed deltas are tested whatever the model has learnt.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_fixtures import assert_openai_error, start_server

pytestmark = pytest.mark.timeout(180)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What's the weather in Oslo?"}]
# What a hermes model writes to call get_weather: forced here by a regex, parsed by the server.
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("server-tools"))
    yield server
    server.stop()


def ask(client: openai.OpenAI, model: str, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", QUESTION), tools=TOOLS,
                                          **kwargs)


def assert_valid_calls(message, count: int | None = None) -> None:
    assert message.tool_calls, message
    if count is not None:
        assert len(message.tool_calls) == count, message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in message.tool_calls}) == len(message.tool_calls)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_function_is_called_with_valid_arguments(client, model, seed):
    choice = ask(client, model, seed=seed, tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert_valid_calls(choice.message, count=1)
    assert choice.message.tool_calls[0].function.name == "add"


def test_required_makes_one_call_of_one_of_the_tools(client, model):
    choice = ask(client, model, seed=4, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message, count=1)


def test_a_forced_call_cut_by_max_tokens_comes_back_as_text_with_length(client, model):
    choice = ask(client, model, seed=4, tool_choice="required", max_tokens=5).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('[{"name"')


def test_auto_parses_the_models_own_hermes_call(client, model):
    choice = ask(client, model, seed=1, extra_body={"structured_outputs": {"regex": HERMES_CALL}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message, count=1)
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_auto_without_a_call_answers_in_text(client, model):
    choice = ask(client, model, seed=1, max_tokens=30, extra_body={"structured_outputs": {"regex": "It is sunny"}})
    message = choice.choices[0].message
    assert message.content == "It is sunny" and not message.tool_calls
    assert choice.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("forced", [False, True])
def test_a_streamed_call_assembles_in_the_clients_stream_helper_as_it_does_unstreamed(client, model, forced):
    options = ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}} if forced
               else {"extra_body": {"structured_outputs": {"regex": HERMES_CALL}}})
    whole = ask(client, model, seed=7, **options).choices[0]
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=1.0,
                                        seed=7, **options) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.done" in events, events
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    streamed = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_a_conversation_with_a_tool_result_is_answered(client, model):
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    choice = ask(client, model, messages=messages, seed=2, tool_choice="none", max_tokens=8).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400_and_the_server_stays_up(server, model):
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
          "tool_choice": "required"}, "tools"),
    ]
    for overrides, param in bad:
        body = {"model": model, "messages": QUESTION, "max_tokens": 8, "tools": TOOLS, **overrides}
        assert_openai_error(server.post("/v1/chat/completions", body), 400, param=param)
    assert server.health() == 200
