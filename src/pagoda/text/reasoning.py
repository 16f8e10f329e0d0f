"""Reasoning parsers: a thinking model's output split into its reasoning (between `<think>` and `</think>`) and
its answer, as vLLM's `--reasoning-parser` does, with vLLM's names:
  qwen3        the output opens `<think>` itself when the model thinks; no tag at the start: no thinking (the
               template was told `enable_thinking: false`, and wrote an empty thinking into the prompt)
  deepseek_r1  the template opens `<think>`, so the output starts inside the thinking and only `</think>`
               appears (a leading `<think>` the model writes anyway is dropped); no `</think>`: all reasoning
Whitespace around the reasoning and before the answer is trimmed; a `<think>` after the start, or any tag after
the thinking has ended, is text like any other.

One implementation reads both ways: `ReasoningStream` takes the text in pieces of any size (a tag may be split
across two), holding back only what may still turn out to be part of a tag or trimmed whitespace; the whole-text
split is one stream fed the whole text. Pure Python: the server, the CLI and tests import it freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """Reasoning and answer text: of a whole output, or what a piece of it adds to each."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningSplit) -> ReasoningSplit:
        return ReasoningSplit(self.reasoning + other.reasoning, self.content + other.content)


def _held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ReasoningStream:
    """One output's split, fed in pieces: `feed` returns what each piece adds to the reasoning and the answer,
    `finish` what was held back (the output has ended, so nothing more can complete a tag)."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = "opening"  # -> "reasoning_start" -> "reasoning" -> "answer_start" -> "answer"
        self._pending = ""  # received, not yet given out
        self.reasoning_ended = False  # `</think>` seen: what follows is the answer

    def feed(self, piece: str) -> ReasoningSplit:
        self._pending += piece
        return self._advance(final=False)

    def finish(self) -> ReasoningSplit:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningSplit:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            pending = self._pending
            if self._phase == "opening":
                stripped = pending.lstrip()
                if stripped.startswith(OPEN):
                    self._pending, self._phase = stripped[len(OPEN):], "reasoning_start"
                elif not final and OPEN.startswith(stripped):
                    break  # only whitespace, or the start of `<think>`, so far
                elif self._starts_in_reasoning:
                    self._pending, self._phase = stripped, "reasoning_start"
                else:
                    self._phase = "answer"  # no thinking: the output is the answer, untouched
            elif self._phase in ("reasoning_start", "answer_start"):
                self._pending = pending.lstrip()
                if not self._pending and not final:
                    break
                self._phase = "reasoning" if self._phase == "reasoning_start" else "answer"
            elif self._phase == "reasoning":
                end = pending.find(CLOSE)
                if end >= 0:
                    reasoning.append(pending[:end].rstrip())
                    self._pending, self._phase = pending[end + len(CLOSE):], "answer_start"
                    self.reasoning_ended = True
                    continue
                if final:
                    reasoning.append(pending.rstrip())
                    self._pending = ""
                    break
                # Held back: a tail that may begin `</think>`, and the whitespace before it (trimmed if the
                # thinking ends there, given out if more reasoning follows).
                body = pending[: len(pending) - _held_back(pending, CLOSE)]
                given = body.rstrip()
                reasoning.append(given)
                self._pending = pending[len(given):]
                break
            else:  # answer
                content.append(pending)
                self._pending = ""
                break
        return ReasoningSplit("".join(reasoning), "".join(content))


class ReasoningParser:
    """A reasoning format: how an output starts (inside the thinking or not); its tags are `<think>` and
    `</think>`. `stream()` reads an output in pieces, `split()` a whole one: the same reading."""

    name: ClassVar[str]
    starts_in_reasoning: ClassVar[bool]

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)

    def split(self, text: str) -> ReasoningSplit:
        stream = self.stream()
        return stream.feed(text) + stream.finish()


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


class ReasoningReader:
    """A stream read from an output's whole text so far, as the engine reports it (each time the text it had
    and more): the reasoning and the answer so far, both only ever growing."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._stream = parser.stream()
        self._read_length = 0
        self._so_far = ReasoningSplit()

    @property
    def reasoning_ended(self) -> bool:
        return self._stream.reasoning_ended

    def read(self, text: str, finished: bool) -> ReasoningSplit:
        if len(text) > self._read_length:
            self._so_far += self._stream.feed(text[self._read_length:])
            self._read_length = len(text)
        if finished:
            self._so_far += self._stream.finish()
        return self._so_far
