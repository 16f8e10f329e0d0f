"""Structured outputs over HTTP: OpenAI's response_format and vLLM's structured_outputs, driven by the official
`openai` client, and the 400s for every constraint the server cannot honour.

One server for the module: the built-in demo model, which was trained to write small JSON objects, so its
constrained output is plausible; the constraints themselves (bounded strings, enums, bounded integers) force
every output to end well within max_tokens whatever the model prefers.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, ValidationError
from server_fixtures import assert_openai_error, start_server

from pagoda.structured import InvalidConstraint, StructuredOutputsParams
from pagoda.wire import ChatCompletionRequest

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 120
SEEDS = (0, 1, 2)
JSON_TASK = [{"role": "user", "content": "Convert to JSON: name=rex, kind=dog, age=3"}]


class Size(enum.Enum):
    SMALL = "small"
    LARGE = "large"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "fox"]
    size: Size
    age: int = Field(ge=0, le=30)


# Only what the demo model has seen (objects of short strings and small integers): JSON may put any whitespace
# between tokens, and a model that never wrote, say, an array is free to pad it with whitespace until max_tokens.
OWNER_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
INVENTORY_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["fruit", "tool", "toy"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "code": {"type": "string", "pattern": "^[a-z]{2,5}$"},
        "owner": OWNER_SCHEMA,
    },
    "required": ["label", "count", "code", "owner"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": INVENTORY_SCHEMA}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("server-structured"), "--no-enable-auto-tool-choice")
    yield server
    server.stop()


def chat(client: openai.OpenAI, model: str, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", JSON_TASK), **kwargs)


def only_choice(response):
    assert len(response.choices) == 1, response
    return response.choices[0]


# --------------------------------------------------------------------------------------------------
# Constrained output
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_parse_returns_the_pydantic_object(client, model, seed):
    response = client.chat.completions.parse(model=model, messages=JSON_TASK, response_format=Pet, temperature=1,
                                             seed=seed, max_tokens=MAX_TOKENS)
    choice = only_choice(response)
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Pet), choice.message


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_is_a_json_object(client, model, seed):
    choice = only_choice(chat(client, model, response_format={"type": "json_object"}, seed=seed))
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_output_validates_against_the_schema(client, model, seed):
    choice = only_choice(chat(client, model, response_format=JSON_SCHEMA_FORMAT, seed=seed))
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), INVENTORY_SCHEMA)


def test_vllm_structured_outputs_json_takes_a_schema_as_json_text(client, model):
    constraint = {"json": json.dumps(INVENTORY_SCHEMA)}
    choice = only_choice(chat(client, model, seed=3, extra_body={"structured_outputs": constraint}))
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), INVENTORY_SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_vllm_structured_outputs_regex_choice_and_grammar(client, model, seed):
    regex = r"[a-z]{3,8}-[0-9]{1,3}"
    choice = only_choice(chat(client, model, seed=seed, extra_body={"structured_outputs": {"regex": regex}}))
    assert re.fullmatch(regex, choice.message.content), choice.message.content
    options = ["yes", "no", "maybe later"]
    choice = only_choice(chat(client, model, seed=seed, extra_body={"structured_outputs": {"choice": options}}))
    assert choice.message.content in options and choice.finish_reason == "stop", choice
    grammar = 'start: "pet is " animal\nanimal: "cat" | "dog" | "fox"'
    choice = only_choice(chat(client, model, seed=seed, extra_body={"structured_outputs": {"grammar": grammar}}))
    assert choice.message.content in {"pet is cat", "pet is dog", "pet is fox"}, choice.message.content


def test_completions_take_response_format_and_agree_with_chat(server, client, model):
    prompt = server.post("/tokenize", {"messages": JSON_TASK}).json()["tokens"]  # chat's prompt, as token ids
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                           extra_body={"response_format": JSON_SCHEMA_FORMAT})
    choice = only_choice(completion)
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.text), INVENTORY_SCHEMA)
    assert only_choice(chat(client, model, response_format=JSON_SCHEMA_FORMAT, seed=7)).message.content == choice.text


def test_stream_gives_the_same_text_as_non_streamed(client, model):
    expected = only_choice(chat(client, model, response_format=JSON_SCHEMA_FORMAT, seed=11)).message.content
    chunks = list(chat(client, model, response_format=JSON_SCHEMA_FORMAT, seed=11, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == expected and finishes == ["stop"], (text, expected, finishes)


def test_max_tokens_ends_a_constrained_request_mid_object_with_length(client, model):
    choice = only_choice(chat(client, model, response_format=JSON_SCHEMA_FORMAT, seed=0, max_tokens=3))
    assert choice.finish_reason == "length", choice
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=model, messages=JSON_TASK, response_format=Pet, max_tokens=3)


def test_logprobs_are_the_raw_distribution_not_the_constrained_one(client, model):
    """A constrained token's logprob is what the model gave it before the mask: below 0 even where the
    constraint allowed nothing else, and its alternatives include tokens the constraint forbade."""
    constraint = {"choice": ["zebra"]}
    choice = only_choice(chat(client, model, seed=0, logprobs=True, top_logprobs=5,
                              extra_body={"structured_outputs": constraint}))
    assert choice.message.content == "zebra", choice
    first = choice.logprobs.content[0]
    assert first.logprob < 0, first
    assert any(not "zebra".startswith(alt.token) for alt in first.top_logprobs), first


def test_tool_choice_none_answers_in_text(client, model):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    choice = only_choice(chat(client, model, tools=tools, tool_choice="none", max_tokens=8))
    assert choice.message.content and not choice.message.tool_calls, choice


# --------------------------------------------------------------------------------------------------
# What the server cannot honour is a 400, never ignored
# --------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}


def json_schema_format(schema: object, name: object = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


BAD_CHAT_REQUESTS = [
    # Constraints the grammar engine refuses.
    ({"response_format": json_schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
     "response_format"),
    ({"response_format": json_schema_format({"type": "array", "items": {"type": "integer"}, "uniqueItems": True})},
     "response_format"),
    ({"response_format": json_schema_format({"not": {"type": "string"}})}, "response_format"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    # Malformed requests.
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": json_schema_format({}, name="has space")}, "response_format"),
    ({"response_format": json_schema_format({}, name="x" * 65)}, "response_format"),
    ({"response_format": json_schema_format([1, 2])}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "answer"}}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "answer", "schema": {}}}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": "a+"}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    # Tools: this server runs without auto tool choice, and a forced call excludes other constraints.
    ({"tools": TOOLS}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": NAMED_TOOL}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
]


@pytest.mark.parametrize("overrides,param", BAD_CHAT_REQUESTS, ids=[json.dumps(o) for o, _ in BAD_CHAT_REQUESTS])
def test_bad_chat_constraints_are_400_naming_the_field(server, model, overrides, param):
    body = {"model": model, "messages": JSON_TASK, "max_tokens": 8, **overrides}
    assert_openai_error(server.post("/v1/chat/completions", body), 400, param=param)
    assert server.health() == 200


BAD_COMPLETION_REQUESTS = [
    ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
]


@pytest.mark.parametrize(
    "overrides,param", BAD_COMPLETION_REQUESTS, ids=[json.dumps(o) for o, _ in BAD_COMPLETION_REQUESTS]
)
def test_bad_completion_constraints_are_400_naming_the_field(server, model, overrides, param):
    body = {"model": model, "prompt": "Convert to JSON: a=1", "max_tokens": 8, **overrides}
    assert_openai_error(server.post("/v1/completions", body), 400, param=param)
    assert server.health() == 200


def test_the_client_sees_auto_tool_choice_refused_in_words_on_a_server_without_it(client, model):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, model, tools=TOOLS)
    assert raised.value.param == "tool_choice"
    assert "--enable-auto-tool-choice" in raised.value.message


def test_text_response_format_is_no_constraint(client, model):
    plain = only_choice(chat(client, model, seed=5, max_tokens=16))
    text = only_choice(chat(client, model, seed=5, max_tokens=16, response_format={"type": "text"}))
    assert text.message.content == plain.message.content


# --------------------------------------------------------------------------------------------------
# Request models (no server)
# --------------------------------------------------------------------------------------------------


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=JSON_TASK, **fields)


def test_response_format_becomes_the_engine_constraint_naming_response_format_in_errors():
    params = chat_request(response_format=JSON_SCHEMA_FORMAT).sampling_params(None).structured_outputs
    assert params == StructuredOutputsParams(json=INVENTORY_SCHEMA)
    assert params.param_for(params.kind) == "response_format"
    params = chat_request(response_format={"type": "json_object"}).sampling_params(None).structured_outputs
    assert params.kind == "json_object" and params.param_for(params.kind) == "response_format"
    assert chat_request(response_format={"type": "text"}).sampling_params(None).structured_outputs is None
    assert chat_request().sampling_params(None).structured_outputs is None


@pytest.mark.parametrize("disable_any_whitespace", [False, True])
def test_vllm_structured_outputs_options_at_their_defaults_are_accepted(disable_any_whitespace):
    fields = {"regex": "a+", "json": None, "json_object": False, "whitespace_pattern": None,
              "disable_any_whitespace": disable_any_whitespace, "disable_fallback": True}
    params = chat_request(structured_outputs=fields).sampling_params(None).structured_outputs
    assert params.cache_key() == StructuredOutputsParams(regex="a+").cache_key()
    assert params.param_for(params.kind) == "structured_outputs.regex"


def test_constraint_errors_at_the_door_name_their_field_in_the_message():
    with pytest.raises(InvalidConstraint) as raised:
        chat_request(structured_outputs={"choice": []}).sampling_params(None)
    assert raised.value.param == "structured_outputs.choice"
    assert str(raised.value).startswith("structured_outputs.choice: ")


def test_malformed_response_format_errors_name_the_nested_field():
    with pytest.raises(ValidationError) as raised:
        chat_request(response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    [error] = raised.value.errors()
    assert error["loc"] == ("response_format",) and error["msg"] == "json_schema.name: Field required", error
