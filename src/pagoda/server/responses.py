"""/v1/responses' answers: a chat completion's choice written as a Response object (output items: reasoning,
message, function calls), its stream of chat chunks written as the Responses API's typed events, and the
store that lets a later request continue a response (`previous_response_id`).

The generation itself is the chat route's (server/generation.py); this module only changes its shape.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagoda.wire import OpenAIError, now
from pagoda.wire.responses import ResponsesRequest

# How long, and how many, responses are kept for previous_response_id and GET /v1/responses/{id}: in memory,
# so bounded in both; the oldest go first.
RESPONSE_TTL_S = 3600.0
MAX_STORED_RESPONSES = 1024


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the inputs (without instructions) and the answer
    stored_at: float


class ResponseStore:
    """Responses kept for a bounded time and number, to be continued or read back."""

    def __init__(self, ttl_s: float = RESPONSE_TTL_S, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.ttl_s, self.max_responses = ttl_s, max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._responses[response["id"]] = StoredResponse(response, conversation, time.monotonic())
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; OpenAIError 404 (naming `param`) when it is unknown or has expired."""
        self._expire()
        stored = self._responses.get(response_id)
        if stored is None:
            raise OpenAIError(404, f"no stored response with id {response_id!r} (responses are kept for "
                                   f"{self.ttl_s:.0f} s, at most {self.max_responses})", param)
        return stored

    def _expire(self) -> None:
        oldest_kept = time.monotonic() - self.ttl_s
        while self._responses and next(iter(self._responses.values())).stored_at < oldest_kept:
            self._responses.popitem(last=False)


@dataclass
class OutputItems:
    """A response's output items as they are built: from a whole message, or from stream deltas."""

    items: list[dict[str, Any]] = field(default_factory=list)

    def reasoning(self, text: str) -> dict[str, Any]:
        return self._add({"type": "reasoning", "id": item_id("rs"), "summary": [],
                          "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})

    def message(self, text: str) -> dict[str, Any]:
        return self._add({"type": "message", "id": item_id("msg"), "role": "assistant", "status": "completed",
                          "content": [output_text(text)]})

    def function_call(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return self._add({"type": "function_call", "id": item_id("fc"), "call_id": call_id, "name": name,
                          "arguments": arguments, "status": "completed"})

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return item


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseAnswer:
    """One /v1/responses call's answer, from its chat completion (whole, or streamed as chunks)."""

    def __init__(self, body: ResponsesRequest, model_name: str, conversation: list[dict[str, Any]],
                 store: ResponseStore) -> None:
        self.body, self.model_name, self.store = body, model_name, store
        self.conversation = conversation  # the chat messages before the answer, without the instructions
        self.id, self.created_at = item_id("resp"), now()

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        incomplete = status == "completed" and finish_reason == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model_name,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "output": output, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": _tool_choice(body), "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": text_format}, "truncation": "disabled", "store": body.store,
            "metadata": body.metadata or {}, "user": body.user, "usage": usage,
        }

    def finish(self, output: list[dict[str, Any]], usage: dict[str, Any] | None,
               finish_reason: str | None) -> dict[str, Any]:
        """The finished response; stored (when the request asks) with the conversation it ends."""
        response = self.response("completed", output, responses_usage(usage), finish_reason)
        if self.body.store:
            self.store.put(response, self.conversation + [_assistant_message(output)])
        return response

    def from_completion(self, completion: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat completion (server/generation.py's `response()`) as a Response."""
        choice = completion["choices"][0]
        message, items = choice["message"], OutputItems()
        if message.get("reasoning"):
            items.reasoning(message["reasoning"])
        if message.get("content"):
            items.message(message["content"])
        for call in message.get("tool_calls") or []:
            items.function_call(call["id"], call["function"]["name"], call["function"]["arguments"])
        return self.finish(items.items, completion.get("usage"), choice["finish_reason"])

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """The Responses API's server-sent events for a streamed chat completion's chunks."""
        stream = EventStream(self)
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"]
                yield stream.event("error", code=str(error.get("code")), message=error["message"],
                                   param=error.get("param"))
                failed = self.response("failed", stream.items.items)
                failed["error"] = {"code": "server_error", "message": error["message"]}
                yield stream.event("response.failed", response=failed)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                for event in stream.delta(choice["delta"]):
                    yield event
                finish_reason = choice.get("finish_reason") or finish_reason
        for event in stream.close():
            yield event
        yield stream.event("response.completed", response=self.finish(stream.items.items, usage, finish_reason))


class EventStream:
    """Chat deltas into Responses events: one output item open at a time (reasoning, then the message or the
    function calls), each opened with `output_item.added` and closed with its `.done` events."""

    def __init__(self, answer: ResponseAnswer) -> None:
        self.answer = answer
        self.items = OutputItems()
        self.sequence_number = 0
        self.open: dict[str, Any] | None = None  # the item being streamed, its text not yet final

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning"):
            events += self._text_delta("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text_delta("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call: its id and name come first, its arguments next
                events += self.close()
                item = self.items.function_call(call["id"], call["function"]["name"], "")
                item["status"] = "in_progress"
                events += self._open(item)
            arguments = call["function"].get("arguments")
            if arguments and self.open is not None:
                self.open["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=self._index(), delta=arguments))
        return events

    def _text_delta(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            item = self.items.reasoning("") if kind == "reasoning" else self.items.message("")
            item["status"] = "in_progress"
            events += self._open(item)
        part = self.open["content"][0]  # type: ignore[index]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self.open["id"], output_index=self._index(),  # type: ignore[index]
                                 content_index=0, delta=text, **extra))
        return events

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.open = item
        shown = {**item, "content": [{**part, "text": ""} for part in item["content"]]} if "content" in item \
            else item
        events = [self.event("response.output_item.added", output_index=self._index(), item=shown)]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(), content_index=0, part=output_text("")))
        return events

    def close(self) -> list[str]:
        """The open item's closing events (none when no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items.items) - 1
        item["status"] = "completed"
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self.event(done, item_id=item["id"], output_index=index, content_index=0,
                                     text=part["text"], **extra))
            if item["type"] == "message":
                events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                         content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _index(self) -> int:
        return len(self.items.items) - 1


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else choice.model_dump()


def _assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the chat message a continuation's template reads (its reasoning left out, as templates
    drop past turns' thinking)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message
