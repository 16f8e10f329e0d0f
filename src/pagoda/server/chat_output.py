"""How a chat choice's text becomes its message: the thinking split off first (`--reasoning-parser`,
pagoda.text.reasoning), then tool calls read from the answer alone (tools.py), so a call written while thinking
is reasoning, not a call. The same reading serves a whole response and a stream, where each choice keeps its
own reader as its text grows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.server.tools import ToolCallReader
from pagoda.text.reasoning import ReasoningParser, ReasoningReader
from pagoda.wire.tool_calls import ToolCall


@dataclass(frozen=True)
class ChoiceReading:
    reasoning: str  # "" without a reasoning parser
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ChatOutputFormat:
    """A chat request's reading of its choices: tool calls (None: tools do not apply) and the reasoning format
    (None: no split; include_reasoning false: split, but the reasoning is not sent)."""

    tools: ToolCallReader | None = None
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True

    @property
    def splits_reasoning(self) -> bool:
        return self.reasoning is not None and self.include_reasoning

    def reader(self) -> ChoiceReader:
        return ChoiceReader(self)


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """A message's or a delta's reasoning under both names clients read: `reasoning` (vLLM's) and
    `reasoning_content` (llama.cpp's, and vLLM's before)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class ChoiceReader:
    """One choice's text, read each time it has grown (the whole text so far, as the engine reports it)."""

    def __init__(self, output_format: ChatOutputFormat) -> None:
        self._tools = output_format.tools
        # A forced call is written by a grammar from the first token: there is no thinking to split off.
        forced = self._tools is not None and self._tools.forced_choice is not None
        parser = None if forced else output_format.reasoning
        self._thinking = ReasoningReader(parser) if parser is not None else None
        self._include_reasoning = output_format.include_reasoning

    def read(self, text: str, finished: bool) -> ChoiceReading:
        reasoning, answer = "", text
        if self._thinking is not None:
            split = self._thinking.read(text, finished)
            reasoning, answer = (split.reasoning if self._include_reasoning else ""), split.content
        if self._tools is None:
            return ChoiceReading(reasoning, answer, [])
        parsed = self._tools.read(answer, finished)
        return ChoiceReading(reasoning, parsed.content, parsed.tool_calls)


def chat_deltas(index: int, new: ChoiceReading, num_tool_calls: int, started: bool) -> list[dict[str, Any]]:
    """One choice's deltas for what it has `new`: its reasoning, its content (the role with the first delta),
    then two per new tool call (one with its id and name, one with its arguments: the shape OpenAI's stream
    helpers assemble)."""
    deltas: list[dict[str, Any]] = []
    if new.reasoning:
        deltas.append(reasoning_fields(new.reasoning))
    if new.content or not (deltas or new.tool_calls):
        deltas.append({"content": new.content} if new.content else {})
    for position, call in enumerate(new.tool_calls, start=num_tool_calls):
        named = {"index": position, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": ""}}
        deltas += [{"tool_calls": [named]},
                   {"tool_calls": [{"index": position, "function": {"arguments": call.arguments}}]}]
    if not started:
        deltas[0] = {"role": "assistant", **deltas[0]}
    return [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
