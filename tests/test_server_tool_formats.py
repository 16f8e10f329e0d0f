"""The `mistral` and `pythonic` tool-call parsers over HTTP with the official client, streamed and not.

Each server runs the built-in model with `--enable-auto-tool-choice --tool-call-parser NAME`. A regex constraint
makes the model write a known output in the parser's format (two calls after some text, or a call that breaks
off), so the server's parsing of a real token stream is tested whatever the model has learnt; the sampled
alternatives in each regex (temperature 1) keep it from being one fixed string.
"""

from __future__ import annotations

import json

import openai
import pytest
from server_fixtures import start_server

pytestmark = pytest.mark.timeout(180)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
QUESTION = [{"role": "user", "content": "What's the weather in Oslo, and what is 1 + 2?"}]

# Per parser: (a regex for text then two calls, its content, a regex for a call broken off)
FORMATS = {
    "mistral": (r'Checking\. \[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Oslo|Rome)"\}'
                r'\[TOOL_CALLS\]add\[ARGS\]\{"a": 1, "b": (2|3)\}', "Checking. ",
                r'\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Os|Ro)'),
    "pythonic": (r'\[get_weather\(city="(Oslo|Rome) \(north\)"\), add\(a=1, b=(2|3)\)\]', None,
                 r'\[get_weather\(city="(Os|Ro)'),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser_server(request, tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp(f"server-{request.param}"), "--enable-auto-tool-choice",
                          "--tool-call-parser", request.param)
    yield request.param, server
    server.stop()


@pytest.fixture(scope="module")
def server(parser_server):
    return parser_server[1]


def ask(client: openai.OpenAI, model: str, regex: str, **kwargs):
    return client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER, ADD], max_tokens=80,
                                          temperature=1.0, extra_body={"structured_outputs": {"regex": regex}},
                                          **kwargs)


def named_calls(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


@pytest.mark.parametrize("seed", [0, 1])
def test_two_calls_after_text_are_read_into_tool_calls(parser_server, client, model, seed):
    name, _ = parser_server
    regex, content, _ = FORMATS[name]
    choice = ask(client, model, regex, seed=seed).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == content
    calls = named_calls(choice.message)
    assert [call for call, _ in calls] == ["get_weather", "add"], calls
    assert calls[0][1]["city"].split()[0] in ("Oslo", "Rome") and calls[1][1]["a"] == 1 and calls[1][1]["b"] in (2, 3)
    assert all(call.id.startswith("call_") and call.type == "function" for call in choice.message.tool_calls)
    assert len({call.id for call in choice.message.tool_calls}) == 2


def test_a_streamed_answer_assembles_to_the_same_calls_and_content(parser_server, client, model):
    name, _ = parser_server
    regex, content, _ = FORMATS[name]
    whole = ask(client, model, regex, seed=3).choices[0]
    options = {"extra_body": {"structured_outputs": {"regex": regex}}}
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=[WEATHER, ADD], max_tokens=80,
                                        temperature=1.0, seed=3, **options) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    kinds = [event.type for event in events]
    assert kinds.count("tool_calls.function.arguments.done") == 2, kinds
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.content == whole.message.content == content
    assert named_calls(final.message) == named_calls(whole.message)
    streamed_text = "".join(event.delta for event in events if event.type == "content.delta")
    assert streamed_text == (content or "")  # no piece of a call leaked into the content


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_breaks_off_comes_back_as_text_and_the_server_stays_up(parser_server, server, client, model,
                                                                          stream):
    name, _ = parser_server
    broken = FORMATS[name][2]
    body = {"model": model, "messages": QUESTION, "tools": [WEATHER, ADD], "max_tokens": 80, "seed": 5,
            "structured_outputs": {"regex": broken}}
    if not stream:
        choice = ask(client, model, broken, seed=5).choices[0]
        text, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    else:
        chunks = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER, ADD], max_tokens=80,
                                                temperature=1.0, seed=5, stream=True,
                                                extra_body={"structured_outputs": {"regex": broken}})
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
        text = "".join(d.delta.content or "" for d in deltas)
        calls = [c for d in deltas for c in d.delta.tool_calls or []]
        finish = deltas[-1].finish_reason
    assert not calls and finish == "stop"
    assert text.rstrip('"').endswith(("Os", "Ro")) and text.startswith("[")
    assert server.post("/v1/chat/completions", {**body, "stream": False}).status_code == 200
    assert server.health() == 200
