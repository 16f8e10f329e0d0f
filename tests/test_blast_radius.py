"""One bad request fails alone, over real HTTP against `pagoda serve` of the built-in model.

Grammar inputs that once failed the whole engine step (every stream in it ended with a 500 event), or that
were answered 500 instead of 400, are each refused with a 400 naming the field, while four greedy streams
started before them run to the end with exactly the text they give alone. A constraint let past the door
(a server whose repeat bound is raised) that then breaks in the engine fails alone: a 400 naming the field
(the client's constraint broke, not the server), marked `X-Pagoda-Error-Scope: request` (or, streamed, an
error event with code 400 and `"scope": "request"`), the streams beside it untouched, the server healthy
and every KV block back.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_fixtures import assert_openai_error, start_server

pytestmark = pytest.mark.timeout(300)

STREAM_TOKENS = 120
STREAM_PROMPTS = ["Reverse the list: red, tea, oslo", "Count from 3 to 9", "Sort: 5, 2, 8", "Copy: k5ad boston"]
HUGE_REPEAT = "x{4294967295}"


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


SCHEMA_POISONS = {
    "ref_to_root": {"$ref": "#"},
    "nested_64_levels": deep_schema(64),
    "recursive_required_ref": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "ref_loop": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
}
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}


def poisons() -> list[tuple[str, str, dict, str]]:
    """(name, route, body, the field its 400 must name)."""
    cases = []
    for name, schema in SCHEMA_POISONS.items():
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        cases.append((f"response_format {name}", "/v1/chat/completions",
                      {**CHAT, "response_format": response_format}, "response_format"))
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            cases.append((f"tools {name} {choice if isinstance(choice, str) else 'named'}", "/v1/chat/completions",
                          {**CHAT, "tools": [tool], "tool_choice": choice}, "tools"))
    cases.append(("structured_outputs regex", "/v1/chat/completions",
                  {**CHAT, "structured_outputs": {"regex": HUGE_REPEAT}}, "structured_outputs.regex"))
    cases.append(("completions structured_outputs json", "/v1/completions",
                  {"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": {"$ref": "#"}}},
                  "structured_outputs.json"))
    return cases


class Stream(threading.Thread):
    """One greedy completion stream: its text, finish reason and any error event."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.started = threading.Event()
        self.text, self.finish_reason, self.errors = "", None, []

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    for choice in event["choices"]:
                        self.text += choice["text"]
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                    self.started.set()
        finally:
            self.started.set()


def alone(url: str, prompt: str) -> str:
    stream = Stream(url, prompt)
    stream.run()
    assert not stream.errors and stream.finish_reason == "length"
    return stream.text


def start_streams(url: str) -> list[Stream]:
    streams = [Stream(url, prompt) for prompt in STREAM_PROMPTS]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60), "a stream never started"
    return streams


def assert_streams_whole(streams: list[Stream], expected: list[str]) -> None:
    for stream, text in zip(streams, expected):
        stream.join(120)
        assert not stream.is_alive()
        assert stream.errors == [] and stream.finish_reason == "length"
        assert stream.text == text


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("blast-radius"), "--no-use-kernels")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loose_server(tmp_path_factory):
    """Repeat counts past llguidance's means are let through the door (and given all the time they need to
    compile on a busy machine): they fail in the engine instead."""
    server = start_server(None, tmp_path_factory.mktemp("blast-radius-loose"), "--no-use-kernels",
                          "--grammar-max-repeat", "5000000000", "--grammar-compile-timeout-s", "300")
    yield server
    server.stop()


def test_every_poison_is_a_400_naming_its_field_while_streams_run_whole(server):
    expected = [alone(server.url, prompt) for prompt in STREAM_PROMPTS]
    streams = start_streams(server.url)
    for name, route, body, param in poisons():
        response = server.post(route, body)
        assert response.status_code == 400, (name, response.text)
        assert_openai_error(response, 400, param=param)
    assert_streams_whole(streams, expected)
    assert server.health() == 200
    server.wait_until_idle()


def test_limits_are_named_in_the_400(server):
    response = server.post("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": HUGE_REPEAT}})
    assert "--grammar-max-repeat" in response.json()["error"]["message"]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(64)}}
    response = server.post("/v1/chat/completions", {**CHAT, "response_format": schema})
    assert "--grammar-max-schema-depth" in response.json()["error"]["message"]


def test_a_constraint_that_breaks_in_the_engine_fails_alone_and_says_so(loose_server):
    url = loose_server.url
    expected = [alone(url, prompt) for prompt in STREAM_PROMPTS]
    streams = start_streams(url)
    poison = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": HUGE_REPEAT}}
    response = loose_server.post("/v1/completions", poison)
    assert response.status_code == 400, response.text
    assert response.headers["X-Pagoda-Error-Scope"] == "request"
    assert_openai_error(response, 400, param="structured_outputs")
    assert "while generating" in response.json()["error"]["message"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**poison, "stream": True}, timeout=60) as streamed:
        assert streamed.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in streamed.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    errors = [event["error"] for event in events if "error" in event]
    assert len(errors) == 1 and errors[0]["code"] == 400 and errors[0]["scope"] == "request"
    assert_streams_whole(streams, expected)
    assert loose_server.health() == 200
    loose_server.wait_until_idle()
    # An expected outcome of the client's input, not a fault in the server: logged in one line, no traceback.
    log = loose_server.log_path.read_text()
    assert "output constraint broke" in log and "Traceback" not in log
