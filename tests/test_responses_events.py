"""The Responses API's event stream and store, from chat chunks, without a model: reasoning, then content, then
tool calls each become their own output item, opened and closed in order; a failure ends the stream with an
error event; stored responses expire by age and count."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.server.responses import ResponseAnswer, ResponseStore
from pagoda.wire import OpenAIError
from pagoda.wire.responses import ResponsesRequest


def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}


def run(answer: ResponseAnswer, chunks: list[dict]) -> list[dict]:
    async def source():
        for item in chunks:
            yield item

    async def collect() -> list[str]:
        return [event async for event in answer.events(source())]

    events = []
    for text in asyncio.run(collect()):
        kind_line, data_line = text.strip().split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_reasoning_content_and_calls_are_items_in_order():
    store = ResponseStore()
    answer = ResponseAnswer(ResponsesRequest(input="hi"), "m", [{"role": "user", "content": "hi"}], store)
    events = run(answer, [
        chunk({"role": "assistant", "reasoning": "Let me ", "reasoning_content": "Let me "}),
        chunk({"reasoning": "think.", "reasoning_content": "think."}),
        chunk({"content": "Calling"}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "g", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, finish_reason="tool_calls"),
        USAGE,
    ])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call", "function_call"]
    # every item is closed before the next opens
    opened = 0
    for event in events:
        if event["type"] == "response.output_item.added":
            assert opened == 0
            opened += 1
        elif event["type"] == "response.output_item.done":
            opened -= 1
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "Let me think."
    response = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and response["status"] == "completed"
    assert [item["type"] for item in response["output"]] == added
    assert response["output"][0]["content"][0]["text"] == "Let me think."
    assert [(i["call_id"], i["name"], i["arguments"]) for i in response["output"][2:]] == [
        ("call_1", "f", '{"a": 1}'), ("call_2", "g", "{}")]
    assert response["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                                 "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 12}
    # stored with the conversation a continuation reads: the answer's text and calls, not its reasoning
    conversation = store.get(response["id"]).conversation
    assert conversation[0] == {"role": "user", "content": "hi"}
    assert conversation[1]["content"] == "Calling" and len(conversation[1]["tool_calls"]) == 2


def test_a_failure_ends_the_stream_with_an_error_and_a_failed_response():
    store = ResponseStore()
    answer = ResponseAnswer(ResponsesRequest(input="hi"), "m", [], store)
    error = {"error": {"message": "internal error (request id x)", "type": "InternalServerError", "param": None,
                       "code": 500, "scope": "request"}}
    events = run(answer, [chunk({"content": "Hel"}), error])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "internal error (request id x)"
    assert events[-1]["response"]["status"] == "failed"
    with pytest.raises(OpenAIError):
        store.get(events[-1]["response"]["id"])  # a failed response is not kept


def test_the_store_forgets_by_age_and_by_count(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("pagoda.server.responses.time.monotonic", lambda: clock[0])
    store = ResponseStore(ttl_s=10.0, max_responses=2)
    for name in ("a", "b", "c"):
        store.put({"id": name}, [])
    with pytest.raises(OpenAIError) as gone:
        store.get("a")
    assert gone.value.status == 404
    assert store.get("b").response == {"id": "b"}
    clock[0] += 11.0
    with pytest.raises(OpenAIError):
        store.get("c")
