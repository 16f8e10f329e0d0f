"""/v1/responses with the official client: plain, streamed, with a tool, continued by previous_response_id,
structured through text.format; its answers equal to the chat route's for the same conversation (greedy), so
the translation is what is tested, not the model.
"""

from __future__ import annotations

import json

import pytest
from server_fixtures import assert_openai_error, make_server_checkpoint, start_server

pytestmark = pytest.mark.timeout(180)

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
GREEDY = {"temperature": 0.0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-responses")
    server = start_server(make_server_checkpoint(directory / "model"), directory, "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat_text(client, model, messages, **kwargs) -> str:
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0.0, max_tokens=12, **kwargs)
    return answer.choices[0].message.content


def test_a_plain_response_is_the_chat_answer_to_the_same_conversation(client, model):
    response = client.responses.create(model=model, input="Tell me a story.", instructions="Be brief.", **GREEDY)
    expected = chat_text(client, model, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Tell me a story."}])
    assert response.status in ("completed", "incomplete")
    assert response.output_text == expected and expected
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_running_out_of_tokens_is_incomplete_with_its_reason(client, model):
    response = client.responses.create(model=model, input="Tell me a story.", temperature=0.0, max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_the_stream_is_ordered_typed_events_whose_deltas_make_the_answer(client, model):
    whole = client.responses.create(model=model, input="Hello there", **GREEDY)
    events = list(client.responses.create(model=model, input="Hello there", stream=True, **GREEDY))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    completed = events[-1].response
    assert completed.output_text == whole.output_text and completed.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == completed.id


def test_a_forced_tool_call_is_a_function_call_item(client, model):
    response = client.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Oslo", "Rome")


def test_a_streamed_tool_call_assembles_from_its_argument_deltas(client, model):
    events = list(client.responses.create(model=model, input="Weather?", tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and json.loads(deltas)["city"] in ("Oslo", "Rome")
    [call] = events[-1].response.output
    assert call.arguments == deltas and call.status == "completed"


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="Tell me a story.", instructions="Be brief.", **GREEDY)
    second = client.responses.create(model=model, input="And then?", previous_response_id=first.id, **GREEDY)
    # OpenAI's rule: instructions are not carried over to a continuation.
    expected = chat_text(client, model, [{"role": "user", "content": "Tell me a story."},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "And then?"}])
    assert second.output_text == expected and second.previous_response_id == first.id
    # the continuation's prompt starts with the first turn's: the prefix cache serves it
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_tool_result_continues_a_call(client, model):
    call = client.responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=60).output[0]
    assert call.type == "function_call"
    answer = client.responses.create(
        model=model, tools=[WEATHER], previous_response_id=None, tool_choice="none", **GREEDY,
        input=[{"role": "user", "content": "Weather in Oslo?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, rain"}])
    expected = chat_text(client, model, [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees, rain"}],
        tools=[CHAT_WEATHER], tool_choice="none")
    assert answer.output_text == expected


def test_text_format_json_schema_constrains_the_answer(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    response = client.responses.create(model=model, input="Pick a city.", max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert json.loads(response.output_text)["city"] in ("Oslo", "Rome")
    assert response.text.format.type == "json_schema"


def test_a_stored_response_is_read_back_and_an_unstored_one_is_not(server, client, model):
    stored = client.responses.create(model=model, input="Hi", **GREEDY)
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    unstored = client.responses.create(model=model, input="Hi", store=False, **GREEDY)
    assert_openai_error(server.get(f"/v1/responses/{unstored.id}"), 404)
    body = {"model": model, "input": "Hi", "previous_response_id": unstored.id}
    assert_openai_error(server.post("/v1/responses", body), 404, param="previous_response_id")


@pytest.mark.parametrize(("overrides", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3.0}, "temperature"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": {"type": "function", "name": "nowhere"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": []}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, model, overrides, param):
    body = {"model": model, "input": "Hi", **overrides}
    assert_openai_error(server.post("/v1/responses", body), 400, param=param)
