"""`pagoda lab`: each lab runs --quick on the built-in model, writes its table and plot, and its lesson holds on
counted quantities (blocks, sequences, tokens), never on timings."""

from __future__ import annotations

import json

import pytest

from pagoda.cli import main
from pagoda.labs.registry import LABS
from pagoda.labs.result import LabResult


def run_lab(name: str, tmp_path, capsys) -> dict:
    assert main(["lab", name, "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lesson holds" in out
    assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_the_kv_formula_is_the_pool_and_the_concurrency(tmp_path, capsys):
    result = run_lab("kv-capacity", tmp_path, capsys)
    rows = result["rows"]
    assert [row["budget_mib"] for row in rows] == [1, 2]
    for row in rows:
        assert row["pool_blocks"] == row["predicted_blocks"] > 0
        # Twice the predicted number of prompts were offered: the pool, not the offer, bounded the step.
        assert row["peak_sequences"] == row["predicted_sequences"] > 0
    assert rows[1]["pool_blocks"] == 2 * rows[0]["pool_blocks"]


def test_the_prefix_cache_skips_exactly_the_shared_whole_blocks(tmp_path, capsys):
    result = run_lab("prefix-cache", tmp_path, capsys)
    off, on = result["rows"]
    assert off["computed"] == off["prompt_tokens"] == off["predicted_computed"]
    assert on["computed"] == on["predicted_computed"] < off["computed"] / 3
    settings = result["settings"]
    prompt = settings["prefix_tokens"] + settings["suffix_tokens"]
    # The first request computes everything; each later one computes its suffix and the prefix's partial block.
    assert on["computed"] == prompt + (settings["requests"] - 1) * (prompt - settings["prefix_tokens"] // 16 * 16)


def test_a_lesson_that_does_not_hold_fails_the_command(tmp_path, monkeypatch, capsys):
    def wrong(model: str, quick: bool) -> LabResult:
        return LabResult(lab="kv-capacity", question="?", columns=[("x", "x")], rows=[{"x": 1}],
                         lesson="a lesson", lesson_holds=False)

    monkeypatch.setattr(LABS["kv-capacity"], "run", wrong)
    monkeypatch.setattr(LABS["kv-capacity"], "plot", lambda result, axes: axes.plot([0], [0]))
    assert main(["lab", "kv-capacity", "--quick", "--out", str(tmp_path)]) == 1
    assert "DOES NOT HOLD" in capsys.readouterr().out


def test_the_list_names_every_lab(capsys):
    assert main(["lab", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in LABS)


def test_priority_lets_urgent_requests_skip_the_queue(tmp_path, capsys):
    result = run_lab("priority", tmp_path, capsys)
    fcfs, priority = result["rows"]
    settings = result["settings"]
    # FCFS: every background request finishes before any urgent one starts; priority: none does.
    assert fcfs["pairs"] == fcfs["predicted_pairs"] == settings["background"] * settings["urgent"]
    assert priority["pairs"] == priority["predicted_pairs"] == 0


def test_each_accepted_draft_token_saves_one_step_and_the_conditional_rate_predicts_it(tmp_path, capsys):
    result = run_lab("speculative", tmp_path, capsys)
    plain, *drafted = result["rows"]
    assert plain["k"] == 0 and plain["accepted"] == 0
    for row in drafted:
        assert row["same_output"] and row["accepted"] > 0  # an engine that never accepts cannot pass
        assert row["steps"] == plain["steps"] - row["accepted"]
        # The truncated geometric's estimate reproduces the measured tokens per step to a few percent (it takes
        # each draft token as accepted independently, while a copied span tends to be accepted whole); the raw
        # ratio falls short by more than that.
        error = abs(row["calc_from_conditional"] - row["tokens_per_step"])
        assert error < 0.05 * row["tokens_per_step"]
        if row["k"] >= 2:  # with one draft token the two rates are the same count
            assert row["calc_from_rate"] < row["tokens_per_step"] - error


def test_continuous_batching_takes_the_steps_calc_predicts_and_fewer_than_static(tmp_path, capsys):
    result = run_lab("static-batching", tmp_path, capsys)
    static, continuous = result["rows"]
    lens, slots = result["settings"]["output_lens"], result["settings"]["max_num_seqs"]
    batches = [lens[start : start + slots] for start in range(0, len(lens), slots)]
    assert static["steps"] == static["predicted_steps"] == sum(max(batch) for batch in batches)
    assert static["wasted"] == sum(slots * max(batch) - sum(batch) for batch in batches)
    assert continuous["steps"] == continuous["predicted_steps"] >= -(-sum(lens) // slots)
    assert continuous["steps"] < static["steps"] and continuous["wasted"] < static["wasted"] / 4
    # The same tokens computed either way: static batching's cost is idle slots, not padded compute.
    assert static["tokens_computed"] == continuous["tokens_computed"] == len(lens) * 8 + sum(lens) - len(lens)
    # Static batching fills its slots only as a batch starts: they are full for less than half the steps.
    occupancy = result["series"]["static"]
    assert max(occupancy) == slots and occupancy.count(slots) < len(occupancy) / 2


def test_a_smaller_budget_caps_the_stall_and_delays_the_long_prompt_as_calc_says(tmp_path, capsys):
    result = run_lab("interference", tmp_path, capsys)
    rows = result["rows"]
    streams, prompt = result["settings"]["streams"], result["settings"]["prompt_tokens"]
    unchunked, *chunked = rows
    # Unchunked, one step carries every stream's decode and the whole prompt.
    assert unchunked["stall_tokens"] == streams + prompt and unchunked["prefill_steps"] == 1
    for row in chunked:
        assert row["stall_tokens"] == row["budget"] == row["predicted_stall_tokens"]
        assert row["prefill_steps"] == row["predicted_prefill_steps"] == -(-prompt // (row["budget"] - streams))
    # Decodes come first in every step: no stream ever skipped one, whatever the budget.
    assert all(row["gap_steps"] == 1 for row in rows)
    assert [row["prefill_steps"] for row in rows] == sorted(row["prefill_steps"] for row in rows)
    assert len({row["prefill_steps"] for row in rows}) == len(rows)


def test_cache_aware_routing_serves_each_history_from_cache_and_round_robin_does_not(tmp_path, capsys):
    result = run_lab("router-policies", tmp_path, capsys)
    round_robin, cache_aware = result["rows"]
    # Given the routes, every request's hit is what the blocks its replica computed before predict.
    assert round_robin["hit_tokens"] == round_robin["predicted_hit_tokens"] > 0
    assert cache_aware["hit_tokens"] == cache_aware["predicted_hit_tokens"]
    # Cache-aware routing reaches the ideal (every turn on the replica of its history); round robin falls short.
    assert cache_aware["hit_rate"] == cache_aware["napkin_hit_rate"] > round_robin["hit_rate"] * 1.5
    assert round_robin["hit_rate"] >= round_robin["napkin_hit_rate"]  # older turns on the same replica hit too
    # Round robin is even by construction; cache-aware stays within a request or two of even.
    replicas, requests = result["settings"]["replicas"], round_robin["requests"]
    assert round_robin["busiest_share"] == -(-requests // replicas) / requests
    assert cache_aware["busiest_share"] <= 1 / replicas + 2 / requests


def test_the_queue_bends_at_the_knee_and_littles_law_holds_on_the_counts(tmp_path, capsys):
    result = run_lab("queueing", tmp_path, capsys)
    rows = result["rows"]
    for row in rows:
        assert row["littles_law"] and row["busy_while_waiting"]  # exact identities on the counted steps
        assert row["predicted_sojourn"] == pytest.approx(result["settings"]["mean_output_tokens"] / (1 - row["rho"]))
    queues, sojourns = [row["queue"] for row in rows], [row["sojourn"] for row in rows]
    assert queues == sorted(queues) and sojourns == sorted(sojourns)
    # Past the knee the queue grows far faster than the load: tripling rho multiplies the queue over tenfold.
    assert queues[-1] > 10 * queues[0] and rows[-1]["rho"] == pytest.approx(3 * rows[0]["rho"])
    assert rows[-1]["within_slo"] < rows[0]["within_slo"]


def test_calc_counts_the_bytes_a_decode_step_reads_and_each_step_computes_the_batch(tmp_path, capsys):
    result = run_lab("roofline", tmp_path, capsys)
    rows, settings = result["rows"], result["settings"]
    # calc's weights read per step are the bytes of the tensors the engine streams; its KV per token the pool's.
    assert settings["weight_bytes_calc"] == settings["weight_bytes_engine"] > 0
    assert settings["kv_bytes_per_token_calc"] == settings["kv_bytes_per_token_pool"] > 0
    assert [row["batch"] for row in rows] == [1, 4, 16]
    for row in rows:  # the engine's own counter: every decode step computed the whole batch, one token each
        assert row["decode_steps"] == settings["output_tokens"] - 1 and row["tokens_per_step"] == row["batch"]
    # The weights are read once a step whatever the batch: only the KV grows with it, so bytes per token fall.
    kv_per_sequence = settings["kv_bytes_per_token_calc"] * settings["context_for_calc"] / 1e6
    for row in rows:
        assert row["bytes_per_step_mb"] == pytest.approx(settings["weight_bytes_calc"] / 1e6
                                                         + row["batch"] * kv_per_sequence)
    per_token = [row["bytes_per_token_mb"] for row in rows]
    assert per_token == sorted(per_token, reverse=True) and per_token[0] > 8 * per_token[-1]
    assert rows[0]["bound"] == "memory"


def test_quantized_bytes_are_calcs_and_accuracy_stays_within_the_gate(tmp_path, capsys):
    result = run_lab("quantization", tmp_path, capsys)
    rows = {row["config"]: row for row in result["rows"]}
    settings = result["settings"]
    fp32, bf16, int8, int4 = rows["fp32"], rows["bf16"], rows["int8"], rows["int4"]
    for row in rows.values():
        assert row["kv_bytes_calc"] == row["kv_bytes_pool"] > 0
    for row in (fp32, bf16, rows["fp32, int8 KV"], rows["fp32, fp8 KV"]):
        assert row["weight_mb_engine"] == row["weight_mb_calc"]
    assert bf16["weight_mb_engine"] == fp32["weight_mb_engine"] / 2
    for row in (int8, int4):  # scales and norms beyond calc's bytes a weight: a small, positive overhead
        assert row["weight_mb_calc"] < row["weight_mb_engine"] <= 1.02 * row["weight_mb_calc"]
    per_token = [row["mb_per_token_calc"] for row in (fp32, bf16, int8, int4)]
    assert per_token == sorted(per_token, reverse=True)
    assert rows["fp32, fp8 KV"]["kv_bytes_pool"] < rows["fp32, int8 KV"]["kv_bytes_pool"] < fp32["kv_bytes_pool"] / 3
    # Accuracy on counted answers: the engine really answers (an engine of garbage would sit "within bounds" of
    # itself), and each quantized path is within the gate's bound of its reference, at least one answer.
    correct, per_family = settings["correct"], settings["items_per_family"]
    assert sum(correct["fp32"].values()) > len(correct["fp32"]) * per_family / 2
    allowed_loss = max(1, int(0.03 * per_family * len(correct["fp32"])))  # 3 points of the mean, in answers
    for name in ("bf16", "int8", "int4"):
        assert sum(correct["fp32"].values()) - sum(correct[name].values()) <= allowed_loss
    for name in ("fp32, int8 KV", "fp32, fp8 KV"):
        assert all(abs(correct[name][family] - count) <= 1 for family, count in correct["fp32"].items())
    assert all(settings["checks"].values())


def test_a_model_without_the_tasks_is_judged_on_its_bytes_and_its_own_kv_scale(tmp_path, capsys, checkpoint):
    # 6,144 fp32 KV bytes a token: the sweep starts at the whole MiB nearest 341 tokens of it, 2 MiB. Rows of
    # 256 and 512 weights keep int8's fp32 scale a row within the lab's 2% of calc's bytes.
    model = checkpoint("llama", hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4, num_kv_heads=4)
    assert main(["lab", "kv-capacity", "--quick", "--model", str(model), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kv-capacity.json").read_text())["rows"]
    assert [row["budget_mib"] for row in rows] == [2, 4]
    assert all(row["peak_sequences"] == row["predicted_sequences"] > 0 for row in rows)

    assert main(["lab", "quantization", "--quick", "--model", str(model), "--out", str(tmp_path)]) == 0
    assert "lesson holds" in capsys.readouterr().out
    result = json.loads((tmp_path / "quantization.json").read_text())
    assert result["settings"]["families"] == []  # no held-out tasks asked of a random model
    rows = {row["config"]: row for row in result["rows"]}
    assert all(row["accuracy"] is None for row in rows.values())
    assert rows["fp32"]["same_as_fp32"] == 1.0
    assert rows["bf16"]["weight_mb_engine"] == rows["fp32"]["weight_mb_engine"] / 2
    assert (tmp_path / "quantization.png").stat().st_size > 10_000
