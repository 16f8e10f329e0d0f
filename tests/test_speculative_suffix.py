"""Suffix decoding: the index (counts, longest match, the drafted continuation and its cut-offs), the proposer's
global index across requests (what one answer teaches the next, FIFO eviction, 0 turning it off), the config
(vLLM's names and defaults), and end to end the output of decoding without speculation under batching, chunked
prefill, preemption, prefix hits, n > 1, seeded sampling and grammars."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from test_speculative import (
    GREEDY,
    PROMPTS,
    REPEATING,
    assert_same_outputs,
    generate,
    record_steps,
    run_staggered,
    spec_stats,
)

from pagoda import SamplingParams
from pagoda.config import SUFFIX_DEFAULTS, SpeculativeConfig
from pagoda.engine.core.request import Request
from pagoda.engine.core.suffix_decoding import SuffixIndex, SuffixProposer, _Cursor
from pagoda.structured import StructuredOutputsParams


def suffix(**options) -> dict:
    return {"method": "suffix", "num_speculative_tokens": 6, **options}


def index_of(*sequences: list[int], depth: int = 8) -> SuffixIndex:
    index = SuffixIndex(depth)
    for tokens in sequences:
        index.extend(_Cursor(), tokens)
    return index


def draft(index: SuffixIndex, context: list[int], max_tokens: int = 8, factor: float = 1.0,
          min_prob: float = 0.1) -> tuple[list[int], float]:
    return index.draft(index.read(context).active, max_tokens, factor, min_prob)


def count(index: SuffixIndex, pattern: list[int]) -> int:
    node = index.root
    for token in pattern:
        if token not in node.children:
            return 0
        node = node.children[token]
    return node.count


# --------------------------------------------------------------------------------------------------
# The index
# --------------------------------------------------------------------------------------------------

def test_the_index_counts_every_substring_up_to_its_depth_however_the_tokens_arrive():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    whole = index_of(tokens, depth=4)
    pieces = SuffixIndex(4)
    cursor = _Cursor()
    for start in range(0, len(tokens), 2):  # as a request grows, a step at a time
        pieces.extend(cursor, tokens[start : start + 2])
    for index in (whole, pieces):
        assert count(index, [1, 2]) == 3 and count(index, [1, 2, 3]) == 2 and count(index, [2, 4, 1]) == 1
        assert count(index, [1, 2, 3, 1]) == 1 and count(index, [1, 2, 3, 1, 2]) == 0  # deeper than 4: not kept
    assert index_of(tokens, depth=4).root.children.keys() == whole.root.children.keys()


def test_removing_a_sequence_leaves_what_the_others_hold():
    index = index_of([5, 6, 7, 8], [6, 7, 9], depth=4)
    index.remove([5, 6, 7, 8])
    assert count(index, [6, 7]) == 1 and count(index, [6, 7, 9]) == 1 and count(index, [5]) == 0
    index.remove([6, 7, 9])
    assert index.root.children == {}


def test_the_draft_follows_the_likeliest_continuation_of_the_longest_match():
    index = index_of([9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [8, 1, 2, 7, 7], depth=8)
    tokens, score = draft(index, [5, 9, 1, 2])
    assert tokens == [3, 4] and score == 2.0  # "9 1 2" matched: what followed it both times
    # After "1 2" alone, 3 followed twice in three (then 4 always): each token's probability is the product so far,
    # and the draft stops where it falls below the cut.
    assert draft(index, [1, 2]) == ([3, 4], pytest.approx(4 / 3))
    assert draft(index, [1, 2], min_prob=0.7) == ([], 0.0)
    assert draft(index, [6]) == ([], 0.0)  # no match: no draft


def test_a_short_match_drafts_little_and_the_depth_bounds_match_and_draft_together():
    index = index_of(list(range(10, 30)), depth=6)
    assert draft(index, [10])[0] == [11]  # one token matched: one drafted (factor 1)
    assert draft(index, [10], factor=3.0)[0] == [11, 12, 13]
    # "10..14" matched is 5 of the depth 6: a shorter match leaves more room, and drafts more.
    assert draft(index, [10, 11, 12, 13, 14])[0] == [15, 16, 17]


def test_a_reading_cursor_holds_the_suffixes_the_index_has_however_it_is_moved():
    index = index_of([1, 2, 3, 4, 2, 3, 5], depth=4)
    context = [9, 1, 2, 3]
    moved = index.read(context[:1])
    index.follow(moved, context[1:])
    for cursor in (index.read(context), moved):
        assert sorted(depth for _, depth in cursor.active) == [1, 2, 3]  # "3", "2 3", "1 2 3"; "9 ..." is not held
        assert {depth: node.count for node, depth in cursor.active} == {1: 2, 2: 2, 3: 1}


# --------------------------------------------------------------------------------------------------
# The proposer
# --------------------------------------------------------------------------------------------------

def make_request(request_id: str, prompt: list[int], output: list[int]) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=64), seed=0, max_model_len=512)
    for token in output:
        request.append_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def proposer(**options) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig.from_dict(suffix(**options)))


ANSWER = [40, 41, 42, 43, 44, 45, 46]  # a structure every answer shares, in no prompt


def test_an_earlier_answer_drafts_the_next_one_and_zero_cached_requests_turns_that_off():
    for max_cached, drafted in ((4, ANSWER[3:6]), (0, [])):  # 3 matched: 3 drafted
        drafts = proposer(suffix_decoding_max_cached_requests=max_cached)
        first = make_request("a", [1, 2, 3], ANSWER)
        drafts.propose([first])
        drafts.finished(first)
        [draft] = drafts.propose([make_request("b", [7, 8, 9], ANSWER[:3])])
        assert draft.token_ids == drafted


def test_the_oldest_finished_answer_leaves_the_global_index_first():
    drafts = proposer(suffix_decoding_max_cached_requests=2)
    for name, answer in (("a", [60, 61, 62, 63]), ("b", [70, 71, 72, 73]), ("c", [80, 81, 82, 83])):
        request = make_request(name, [1], answer)
        drafts.propose([request])
        drafts.finished(request)
    assert list(drafts.outputs) == ["b", "c"] and count(drafts.shared, [60]) == 0
    [draft] = drafts.propose([make_request("d", [2], [80, 81])])
    assert draft.token_ids == [82, 83]
    assert drafts.outputs.keys() == {"c", "d"} and count(drafts.shared, [70]) == 0  # b left for the running d


def test_a_requests_own_index_drafts_from_its_prompt_and_goes_when_it_finishes():
    drafts = proposer(suffix_decoding_max_cached_requests=0)
    request = make_request("a", [5, 6, 7, 8, 9, 5, 6], [7])
    [draft] = drafts.propose([request])
    assert draft.token_ids == [8, 9, 5]  # "5 6 7" matched: three drafted
    drafts.finished(request)
    assert drafts.requests == {}


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

def test_config_takes_vllms_names_and_defaults():
    config = SpeculativeConfig.from_dict({"method": "suffix"})
    assert config.num_speculative_tokens == SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"] == 24
    options = config.suffix_options()
    assert (options.max_cached_requests, options.max_spec_factor, options.min_token_prob) == (10000, 1.0, 0.1)
    given = SpeculativeConfig.from_dict(suffix(suffix_decoding_max_spec_factor=2, suffix_decoding_max_tree_depth=16))
    assert given.suffix_options().max_spec_factor == 2.0 and given.num_speculative_tokens == 6
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 12}) \
        .num_speculative_tokens == 12


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 8}, "cannot be used"),
    (suffix(prompt_lookup_max=3), "cannot be used"),
    (suffix(suffix_decoding_max_tree_depth=1), "at least 2"),
    (suffix(suffix_decoding_max_cached_requests=-1), "at least 0"),
    (suffix(suffix_decoding_min_token_prob=1.5), r"\[0, 1\]"),
    (suffix(suffix_decoding_max_spec_factor="2"), "must be a number"),
])
def test_config_refuses_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(options)


# --------------------------------------------------------------------------------------------------
# End to end: equal to decoding without speculation
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repetitive_dir(checkpoint):
    return checkpoint("llama", init_std=0.1)


@pytest.fixture(scope="module")
def random_dir(checkpoint):
    return checkpoint("llama")


@pytest.fixture(params=["repetitive", "random"])
def model_dir(request, repetitive_dir, random_dir):
    return repetitive_dir if request.param == "repetitive" else random_dir


def test_batched_greedy_output_is_unchanged_and_answers_teach_the_next_round(make_llm, model_dir):
    expected = generate(make_llm(model_dir), PROMPTS, GREEDY)
    llm = make_llm(model_dir, speculative_config=suffix())
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))
    first = spec_stats(llm)
    assert_same_outputs(expected, generate(llm, PROMPTS, GREEDY))  # prefix hits, and a global index of answers
    second = spec_stats(llm)
    assert second.num_accepted_tokens - first.num_accepted_tokens > first.num_accepted_tokens
    assert llm.engine.speculator.proposer.requests == {}, "a finished request's index was kept"


def test_chunked_prefill_beside_speculating_decodes(make_llm, repetitive_dir):
    prompts = [REPEATING[0], *random_prompts([37, 23], seed=9), REPEATING[1]]
    arrivals = [0, 3, 5, 6]
    options = {"max_num_batched_tokens": 8}
    expected = run_staggered(make_llm(repetitive_dir, **options), prompts, GREEDY, arrivals)
    llm = make_llm(repetitive_dir, speculative_config=suffix(), **options)
    steps = record_steps(llm)
    assert_same_outputs(expected, run_staggered(llm, prompts, GREEDY, arrivals))
    assert any(any(d for d, _ in step) and any(not decode for _, decode in step) for step in steps)


def test_preemption_and_recompute(make_llm, repetitive_dir):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    options = {"num_kv_blocks": 24}
    expected = generate(make_llm(repetitive_dir, **options), PROMPTS[:5], params)
    llm = make_llm(repetitive_dir, speculative_config=suffix(), **options)
    assert_same_outputs(expected, generate(llm, PROMPTS[:5], params))
    assert llm.engine.stats().num_preemptions > 0 and spec_stats(llm).num_accepted_tokens > 0


def test_n_samples_seeded_sampling_and_grammars(make_llm, model_dir):
    regex = StructuredOutputsParams(regex=r"(ab|cd|a b)+ end\.")
    params = [
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=regex),
        SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    prompts = PROMPTS[:4]
    expected = generate(make_llm(model_dir), prompts, params)
    llm = make_llm(model_dir, speculative_config=suffix())
    assert_same_outputs(expected, generate(llm, prompts, params))
    assert_same_outputs(expected, generate(llm, prompts, params))
