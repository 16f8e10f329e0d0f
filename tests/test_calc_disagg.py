"""`pagoda calc --disagg`: the handoff a prefill replica sends a decode replica, its time on a link, and the
napkin rule for when the split pays. The bytes are checked against a real transfer's counter in
tests/test_disaggregation.py; here, against hand-worked figures."""

from __future__ import annotations

import argparse
import json

import pytest

from pagoda.calc import cli
from pagoda.calc import formulas as f


def calc_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    parser = argparse.ArgumentParser(prog="pagoda")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calc", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_the_handoff_is_the_full_blocks_before_the_last_prompt_token_less_the_decode_sides_cache():
    assert f.handoff_blocks(16, 16) == 0  # the only block holds the last prompt token: nothing to move
    assert f.handoff_blocks(17, 16) == 1
    assert f.handoff_blocks(4096, 16) == 255
    assert f.handoff_blocks(4096, 16, decode_prefix_len=1000) == 255 - 62  # whole cached blocks only
    assert f.handoff_blocks(100, 16, decode_prefix_len=500) == 0
    # Llama-3-8B in bf16: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 bytes a token.
    assert f.handoff_bytes(4096, 16, 131_072) == 4080 * 131_072


def test_llama_3_8b_moves_535_mb_per_4k_prompt_in_11_ms_at_50_gb_per_s(capsys):
    out = calc_json(capsys, "--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt-len", "4096", "--disagg")
    split = out["disagg"]
    assert split["handoff_blocks"] == 255 and split["handoff_tokens"] == 4080
    assert split["handoff_bytes"] == 4080 * out["memory"]["kv_bytes_per_token"] == 534_773_760
    assert split["transfer_s"] == pytest.approx(534_773_760 / 50e9)
    # The moved tokens' prefill at half the H100's peak: 2 x 7.5e9 matmul params x 4080 + causal attention.
    flops = f.prefill_flops(7_504_924_672, 32, 4096, 4080)
    assert split["prefill_saved_s"] == pytest.approx(flops / (0.5 * 989e12))
    assert split["moves_faster_than_recompute"] is True
    assert split["prefill_share"] == pytest.approx(out["prefill"]["prefill_s"])  # 1 request/s


def test_the_split_pays_for_long_prompts_at_rate_and_not_for_chat_or_a_slow_link(capsys):
    heavy = ("--model", "llama-3-8b", "--gpu", "h100-sxm", "--prompt-len", "8192", "--output-len", "64", "--disagg")
    assert calc_json(capsys, *heavy, "--request-rate", "20")["disagg"]["split_pays"] is True
    # Rare prompts: a colocated replica seldom stalls its decodes; a second pool would idle.
    assert calc_json(capsys, *heavy, "--request-rate", "0.1")["disagg"]["split_pays"] is False
    # 1 GB/s (8 Gb/s): moving the KV takes longer than computing it again.
    slow = calc_json(capsys, *heavy, "--request-rate", "20", "--kv-link-gbps", "1")["disagg"]
    assert slow["moves_faster_than_recompute"] is False and slow["split_pays"] is False
    assert calc_json(capsys, *heavy, "--request-rate", "20", "--prefix-len", "8192")["disagg"]["handoff_bytes"] == 0


def test_disagg_needs_the_kv_shape_and_sane_figures(capsys):
    parser = argparse.ArgumentParser(prog="pagoda")
    cli.add_parser(parser.add_subparsers(dest="command"))
    for argv, named in ((["--model", "70B"], "KV shape"), (["--kv-link-gbps", "0"], "kv_link_gbps"),
                        (["--output-len", "0"], "output_len"), (["--request-rate", "-1"], "request_rate")):
        args = parser.parse_args(["calc", "--disagg", *argv])
        assert args.func(args) == 2
        assert named in capsys.readouterr().err
