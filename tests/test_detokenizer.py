"""Incremental detokenization and stop strings: deltas add up to the full decode, multi-byte characters
split across tokens included, and a stop string is cut out even when it straddles tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagoda import SamplingParams
from pagoda.engine.core.request import Request
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.output_processor import SequenceText
from pagoda.text.tokenizer import load_tokenizer

VOCAB_SIZE = 512
MULTI_BYTE = "中文日本語한국어🙂🚀👍🏽naïveΕλληνικάПривет→€—café"
ALPHABET = st.sampled_from(list(MULTI_BYTE) + list("abcdefgh xyz.,\n\t0123456789"))
TEXT = st.text(alphabet=ALPHABET, min_size=1, max_size=40)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint("llama"))


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def incremental(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    return [detokenizer.add(token_id) for token_id in ids]


def test_multi_byte_characters_are_split_across_tokens(tokenizer):
    """The premise of the tests below: some tokens hold only part of a character."""
    ids = tokenizer.encode("中文 🙂 naïve", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)
    deltas = incremental(tokenizer, ids)
    assert "".join(deltas) == "中文 🙂 naïve"
    assert not any("\ufffd" in delta for delta in deltas), "a half character was emitted"


@given(pieces=st.lists(TEXT, min_size=1, max_size=4))
def test_deltas_concatenate_to_full_decode_of_text(tokenizer, pieces):
    # Pieces tokenized separately: token boundaries that plain tokenization of the whole would not make.
    ids = [token_id for piece in pieces for token_id in tokenizer.encode(piece, add_special_tokens=False)]
    deltas = incremental(tokenizer, ids)
    assert "".join(deltas) == full_decode(tokenizer, ids)
    assert not any("\ufffd" in delta for delta in deltas)


@given(ids=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40))
def test_deltas_concatenate_to_full_decode_of_random_ids(tokenizer, ids):
    """Any ids, special tokens and stray bytes included. Only a trailing incomplete character (decoded as
    U+FFFD) may still be held back at the end, waiting for bytes that have not come."""
    text = "".join(incremental(tokenizer, ids))
    full = full_decode(tokenizer, ids)
    if full.endswith("\ufffd"):
        assert full.startswith(text)
        assert "\ufffd" in full[len(text) :]
    else:
        assert text == full


def make_text(tokenizer, stop: list[str], eos: tuple[int, ...] = (1,), ignore_eos: bool = False) -> SequenceText:
    params = SamplingParams(stop=stop, ignore_eos=ignore_eos)
    request = Request(request_id="r", prompt_token_ids=[0], params=params, seed=0, eos_token_ids=eos)
    return SequenceText(request, IncrementalDetokenizer(tokenizer))


def feed(sequence: SequenceText, ids: list[int]) -> tuple[str | None, int | None, list[str]]:
    """Adds tokens until a stop string appears; returns (stop, index of that token, visible texts)."""
    shown = []
    for index, token_id in enumerate(ids):
        sequence.request.append_token(token_id)
        if sequence.add_tokens([token_id], None):
            assert isinstance(sequence.stop_reason, str) and sequence.finished
            return sequence.stop_reason, index, shown
        shown.append(sequence.visible_text())
    return None, None, shown


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    ids = tokenizer.encode("hello world, and more", add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "o wor" not in pieces and "hello" not in pieces, "premise: the stop string spans tokens"
    sequence = make_text(tokenizer, stop=["o wor"])
    stop, index, shown = feed(sequence, ids)
    assert stop == "o wor"
    assert "o wor" in full_decode(tokenizer, ids[: index + 1])
    assert "o wor" not in full_decode(tokenizer, ids[:index]), "stopped at the token completing the stop"
    assert sequence.visible_text() == "hell"
    assert all("hell".startswith(text) for text in shown), f"showed text later retracted: {shown}"


@given(text=st.text(alphabet=ALPHABET, min_size=4, max_size=40), data=st.data())
def test_stop_strings_never_leak(tokenizer, text, data):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = full_decode(tokenizer, ids)
    start = data.draw(st.integers(0, len(decoded) - 1))
    length = data.draw(st.integers(1, min(6, len(decoded) - start)))
    stop_string = decoded[start : start + length]
    sequence = make_text(tokenizer, stop=["never-seen", stop_string])
    stop, index, shown = feed(sequence, ids)
    expected = decoded[: decoded.find(stop_string)]
    assert stop == stop_string
    assert sequence.visible_text() == expected
    assert stop_string not in full_decode(tokenizer, ids[:index]), "stopped late"
    for visible in shown:
        assert expected.startswith(visible), f"{visible!r} was shown, but the final text is {expected!r}"


def test_a_stop_string_inside_a_run_of_tokens_ends_the_output_at_its_token(tokenizer):
    """A speculative step appends several tokens at once: the output shown ends at the token that completes
    the stop string, its logprobs with it, whatever the scheduler appended after it."""
    ids = tokenizer.encode("hello world, and more", add_special_tokens=False)
    sequence = make_text(tokenizer, stop=["o wor"])
    stop_index = next(i for i in range(len(ids)) if "o wor" in full_decode(tokenizer, ids[: i + 1]))
    for token_id in ids:
        sequence.request.append_token(token_id)
    logprobs = [{token_id: -float(index)} for index, token_id in enumerate(ids)]
    assert sequence.add_tokens(ids, logprobs)
    completion = sequence.completion()
    assert completion.token_ids == ids[: stop_index + 1] and stop_index + 1 < len(ids)
    assert completion.text == "hell" and completion.finish_reason == "stop" and completion.stop_reason == "o wor"
    assert sequence.logprobs == logprobs[: stop_index + 1]


def test_without_stop_strings_text_streams_immediately(tokenizer):
    ids = tokenizer.encode("plain words", add_special_tokens=False)
    sequence = make_text(tokenizer, stop=[])
    _, _, shown = feed(sequence, ids)
    assert shown[-1] == "plain words"


def test_eos_adds_no_text_unless_ignored(tokenizer):
    ids = tokenizer.encode("ab", add_special_tokens=False)
    sequence = make_text(tokenizer, stop=[], eos=(ids[-1],))
    feed(sequence, ids)
    assert sequence.text == full_decode(tokenizer, ids[:-1])
    ignoring = make_text(tokenizer, stop=[], eos=(ids[-1],), ignore_eos=True)
    feed(ignoring, ids)
    assert ignoring.text == full_decode(tokenizer, ids)


def test_stop_string_end_to_end(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama"))
    prompt = [17, 230, 94, 311, 402]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    baseline = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    full = baseline.text
    assert full == full_decode(tokenizer, baseline.token_ids)
    # A 4-character stop string straddling a token boundary in the middle of the output.
    for boundary in range(8, 20):
        cut = len(full_decode(tokenizer, baseline.token_ids[:boundary]))
        stop_string = full[cut - 2 : cut + 2]
        if len(stop_string) == 4 and "\ufffd" not in stop_string and full.find(stop_string) == cut - 2:
            break
    else:
        pytest.fail(f"no usable token boundary in {full!r}")
    completion = llm.generate([prompt], SamplingParams(stop=[stop_string], **greedy), use_tqdm=False)[0].outputs[0]
    assert completion.text == full[: cut - 2]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_string
    last = next(i for i in range(1, 25) if stop_string in full_decode(tokenizer, baseline.token_ids[:i]))
    assert completion.token_ids == baseline.token_ids[:last]
