"""The reasoning parsers on whole outputs, and streamed in every split into two and three pieces: a stream's
pieces always add up to the whole-text split, whichever piece a tag is cut in."""

from __future__ import annotations

import itertools

import pytest

from pagoda.text.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningReader,
    ReasoningSplit,
)

QWEN3, R1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()

# (parser, output, reasoning, content)
WHOLE = [
    (QWEN3, "<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    (QWEN3, "<think>abc</think>answer", "abc", "answer"),
    (QWEN3, "It is 4.", "", "It is 4."),  # enable_thinking false: no tags at all
    (QWEN3, "  <think>a</think>b", "a", "b"),
    (QWEN3, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    (QWEN3, "<think></think>", "", ""),
    (QWEN3, "<thin", "", "<thin"),  # the start of a tag that never came is text
    (QWEN3, "Say <think> to think.", "", "Say <think> to think."),  # a tag after the start is text
    (QWEN3, "<think>a < b </thinking> c</think>d</think>", "a < b </thinking> c", "d</think>"),
    (QWEN3, "<think>x</think>\n<tool_call>{}</tool_call>", "x", "<tool_call>{}</tool_call>"),
    (R1, "I add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    (R1, "<think>\nabc</think>answer", "abc", "answer"),  # the model opened it anyway
    (R1, "no end of the thinking", "no end of the thinking", ""),
    (R1, "</think>only an answer", "", "only an answer"),
    (R1, "a\n\n b \n</thin", "a\n\n b \n</thin", ""),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), WHOLE)
def test_a_whole_output_splits_into_reasoning_and_content(parser, text, reasoning, content):
    assert parser.split(text) == ReasoningSplit(reasoning, content)


def pieces_of(text: str, num_pieces: int):
    """Every way to cut `text` into `num_pieces` pieces (empty pieces included)."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), num_pieces - 1):
        bounds = (0, *cuts, len(text))
        yield [text[start:end] for start, end in itertools.pairwise(bounds)]


def streamed(parser: ReasoningParser, pieces: list[str]) -> ReasoningSplit:
    stream, total = parser.stream(), ReasoningSplit()
    for piece in pieces:
        total += stream.feed(piece)
    return total + stream.finish()


@pytest.mark.parametrize("num_pieces", [2, 3])
@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), WHOLE)
def test_every_split_into_pieces_streams_to_the_whole_texts_split(parser, text, reasoning, content, num_pieces):
    for pieces in pieces_of(text, num_pieces):
        assert streamed(parser, pieces) == ReasoningSplit(reasoning, content), pieces


def test_no_tag_leaks_while_streaming_and_the_reasoning_is_given_out_as_it_comes():
    stream, given = R1.stream(), []
    for piece in ["I think", " more", " </th", "ink>", "Hi"]:
        given.append(stream.feed(piece))
    assert given == [ReasoningSplit("I think"), ReasoningSplit(" more"), ReasoningSplit(), ReasoningSplit(),
                     ReasoningSplit(content="Hi")]
    assert stream.reasoning_ended


def test_the_reader_takes_the_growing_whole_text_and_finishes_what_was_held_back():
    reader = ReasoningReader(QWEN3)
    assert reader.read("<think>ab", False) == ReasoningSplit("ab")
    assert reader.read("<think>ab</thi", False) == ReasoningSplit("ab")
    assert not reader.reasoning_ended
    assert reader.read("<think>ab</think>c", False) == ReasoningSplit("ab", "c")
    assert reader.reasoning_ended
    reader = ReasoningReader(QWEN3)
    assert reader.read("<thi", False) == ReasoningSplit()
    assert reader.read("<thi", True) == ReasoningSplit(content="<thi")


def test_the_parsers_go_by_vllms_names():
    assert {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser} == REASONING_PARSERS
