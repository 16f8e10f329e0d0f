"""The parts of prefill/decode disaggregation that need no server: held blocks (pool accounting, serving, the
timeout), vLLM's kv_transfer_params as pagoda reads them, and the router's prefill request and flags."""

from __future__ import annotations

import argparse

import pytest

from pagoda.engine.core.kv_cache import KVCacheManager
from pagoda.engine.core.request import Request, RequestStatus
from pagoda.engine.kv_connector.transfer import HeldBlocks
from pagoda.kv_transfer_params import KVTransferParams
from pagoda.router.cli import add_parser, replica_pools
from pagoda.router.disaggregated import prefill_request, splits
from pagoda.sampling import SamplingParams


def finished_request(num_tokens: int, block_size: int, kv_cache: KVCacheManager) -> Request:
    request = Request("r", list(range(5, 5 + num_tokens)), SamplingParams(), seed=0)
    kv_cache.allocate_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    kv_cache.cache_full_blocks(request)
    request.status = RequestStatus.FINISHED
    return request


def test_held_blocks_stay_in_use_until_released_and_then_are_cached():
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    request = finished_request(14, 4, kv_cache)
    held_ids = request.block_ids[:3]
    kv_cache.free(request, num_held=3)
    kv_cache.check_invariants()
    assert kv_cache.num_held_blocks == 3 and kv_cache.num_free_blocks == 5
    kv_cache.release_held("r")
    kv_cache.check_invariants()
    assert kv_cache.num_free_blocks == 8
    again = Request("r2", list(range(5, 5 + 14)), SamplingParams(), seed=0)
    hits, num_hit_tokens = kv_cache.get_computed_blocks(again)
    assert [block.block_id for block in hits] == held_ids and num_hit_tokens == 12


def test_a_pull_reads_held_blocks_once_and_the_timeout_spares_one_being_read():
    now = [0.0]
    held = HeldBlocks(clock=lambda: now[0])
    held.add("a", [4, 5, 6], [b"h4", b"h5", b"h6"], timeout_s=10)
    held.add("b", [7], [b"h7"], timeout_s=10)
    assert isinstance(held.begin_serving("a", [9]), str)  # not what it holds
    assert held.begin_serving("a", [4, 5]) == [(4, b"h4"), (5, b"h5")]
    assert isinstance(held.begin_serving("a", [4, 5]), str)  # one pull at a time
    now[0] = 11.0
    assert held.take_released() == ["b"]  # timed out; "a" is being read
    held.finish_serving("a")
    assert held.take_released() == ["a"]
    assert isinstance(held.begin_serving("a", [4]), str) and held.num_blocks == 0


@pytest.mark.parametrize("values", [
    {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1},  # no remote_request_id
    {"do_remote_decode": True, "do_remote_prefill": True},
    {"remote_block_ids": [1, -2]},
    {"remote_port": 70000},
    {"do_remote_decode": "yes"},
    {"tp_size": 2},
    {"unknown": 1},
])
def test_malformed_kv_transfer_params_name_the_field(values):
    with pytest.raises(ValueError, match="kv_transfer_params") as raised:
        KVTransferParams.from_dict(values)
    assert raised.value.param == "kv_transfer_params"


def test_a_prefill_answer_round_trips():
    params = KVTransferParams(do_remote_prefill=True, remote_engine_id="e", remote_request_id="r",
                              remote_block_ids=(3, 4), remote_host="10.0.0.5", remote_port=4000)
    assert KVTransferParams.from_dict(params.as_dict()) == params


def test_the_prefill_request_keeps_the_prompt_and_asks_for_one_held_token():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 3, "stop": ["x"],
            "max_completion_tokens": 50, "min_tokens": 4, "tools": [{"type": "function"}], "cache_salt": "s",
            "kv_transfer_params": {"do_remote_prefill": True}}
    prefill = prefill_request(body)
    assert prefill == {"model": "m", "messages": body["messages"], "tools": body["tools"], "cache_salt": "s",
                       "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    assert splits("/v1/completions", {"prompt": [1, 2, 3]}) and splits("/v1/completions", {"prompt": "a"})
    assert not splits("/v1/completions", {"prompt": ["a", "b"]})
    assert not splits("/v1/responses", {"input": "a"})


def route_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["route", *argv])


def test_route_flags_take_one_mode_or_the_other():
    assert replica_pools(route_args("--replica", "http://a")) == (["http://a"], [])
    assert replica_pools(route_args("--pd-disaggregation", "--prefill", "http://p", "--decode", "http://d")) == (
        ["http://d"], ["http://p"])
    for argv in (("--prefill", "http://p"), (), ("--pd-disaggregation", "--decode", "http://d"),
                 ("--pd-disaggregation", "--replica", "http://a", "--prefill", "http://p", "--decode", "http://d"),
                 ("--pd-disaggregation", "--prefill", "http://a", "--decode", "http://a")):
        with pytest.raises(ValueError):
            replica_pools(route_args(*argv))


def test_cached_prefix_blocks_counts_whole_cached_blocks_under_the_same_salt_never_the_last_tokens():
    kv_cache = KVCacheManager(num_blocks=8, block_size=4)
    request = finished_request(14, 4, kv_cache)  # tokens 5..18: blocks [5..8], [9..12], [13..16] cached
    kv_cache.free(request)
    prompt = list(range(5, 5 + 14))
    assert kv_cache.cached_prefix_blocks(prompt) == 3
    assert kv_cache.cached_prefix_blocks(prompt[:12]) == 2  # the third block holds the last prompt token
    assert kv_cache.cached_prefix_blocks(prompt[:4] + [99] + prompt[5:]) == 1  # a different second block
    assert kv_cache.cached_prefix_blocks(prompt, cache_salt="tenant") == 0
    # What it said is what admission finds.
    again = Request("r2", prompt, SamplingParams(), seed=0)
    assert kv_cache.get_computed_blocks(again)[1] == 3 * 4
    kv_cache.check_invariants()
