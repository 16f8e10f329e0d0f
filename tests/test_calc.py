"""`pagoda calc`: the textbook worked examples, parameter counts, and the CLI's contract."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pagoda.calc import cli
from pagoda.calc import formulas as f
from pagoda.calc.presets import MODEL_CONFIGS, resolve_gpu, resolve_model
from pagoda.calc.render import format_bytes
from pagoda.calc.shapes import GpuSpec, parse_param_count

LLAMA_3_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def calc_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    """Run `pagoda calc ... --json` through a parser built the way the main CLI builds it."""
    parser = argparse.ArgumentParser(prog="pagoda")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calc", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


# --- the worked examples, as pure formulas ---------------------------------------------------------


def test_70b_fp16_weighs_140_gb_and_decodes_about_24_steps_per_s_on_an_h100():
    weights = f.weight_bytes(70e9, "fp16")
    assert weights == 140e9
    steps_per_s = 1 / f.step_time_floor(weights, flops=0, bandwidth=3.35e12, peak_flops=989e12)
    assert steps_per_s == pytest.approx(23.93, abs=0.01)
    assert round(steps_per_s) == 24


def test_llama_3_70b_kv_is_327680_bytes_per_token_and_an_8k_sequence_2_5_gib():
    per_token = f.kv_bytes_per_token(num_layers=80, num_kv_heads=8, head_dim=128, kv_dtype="fp16")
    assert per_token == 327_680
    per_sequence = per_token * 8192
    assert per_sequence == 2_684_354_560  # 2.68 GB ...
    assert per_sequence / f.GiB == 2.5  # ... which is exactly 2.5 GiB


def test_ridge_point_of_990_tflops_and_3_35_tbps_is_about_295_flop_per_byte():
    ridge = f.ridge_point(990e12, 3.35e12)
    assert ridge == pytest.approx(295.5, abs=0.1)


def test_three_dollars_an_hour_at_5000_tokens_per_s_is_0_167_per_million():
    assert round(f.cost_per_million_tokens(3.0, 5000), 3) == 0.167


def test_shared_prefix_reuses_whole_blocks_only():
    assert f.prefix_reusable_tokens(prompt_len=2000, prefix_len=1800, block_size=16) == 1792


def test_the_last_prompt_token_is_always_recomputed():
    # A fully cached 32-token prompt still computes its last block, to get the next token's logits.
    assert f.prefix_reusable_tokens(prompt_len=32, prefix_len=32, block_size=16) == 16


def test_chunked_prefill_of_8000_tokens_with_100_decodes_in_a_2048_budget_takes_5_steps():
    assert f.chunked_prefill_steps(prompt_len=8000, token_budget=2048, running_decodes=100) == 5
    assert f.chunked_prefill_steps(prompt_len=8000, token_budget=100, running_decodes=100) is None


def test_speculative_expected_tokens_for_alpha_0_8_and_k_5_is_3_689():
    assert round(f.spec_expected_tokens(0.8, 5), 3) == 3.689
    assert f.spec_expected_tokens(1.0, 5) == 6  # every draft accepted, plus the target's own token
    assert f.spec_expected_tokens(0.0, 5) == 1
    assert f.spec_speedup(0.8, 5, draft_cost=0.05) == pytest.approx(3.68928 / 1.25)


def test_best_k_balances_acceptance_against_draft_cost():
    assert f.best_spec_k(0.8, draft_cost=0.0) == 16  # free drafts: draft as many as allowed
    assert f.best_spec_k(0.5, draft_cost=0.3) < f.best_spec_k(0.9, draft_cost=0.3)


def test_gqa_kv_heads_are_replicated_when_gpus_outnumber_them():
    assert f.kv_heads_per_gpu(8, 4) == 2
    assert f.kv_heads_per_gpu(8, 16) == 1


def test_long_contexts_keep_decode_memory_bound_at_any_batch():
    ridge = 295.0
    assert f.compute_bound_batch(2 * 8e9, 16e9, kv_bytes_per_sequence=0, ridge=ridge) == pytest.approx(295)
    assert f.compute_bound_batch(2 * 8e9, 16e9, kv_bytes_per_sequence=1e9, ridge=ridge) is None


# --- models and GPUs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "params"),
    [
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("qwen2.5-7b", 7_615_616_512),  # with Qwen2's q/k/v biases
        ("bench-125m", 124_635_456),  # scripts/make_bench_models.py expects 124.6M
    ],
)
def test_presets_count_the_published_parameters(preset: str, params: int):
    assert resolve_model(preset).num_params == params


def test_a_config_json_reads_like_its_preset(tmp_path):
    path = tmp_path / "Llama-3-70B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_3_70B_CONFIG))
    from_file, from_dir = resolve_model(str(path)), resolve_model(str(path.parent))
    preset = resolve_model("llama-3-70b")
    assert from_file.num_params == from_dir.num_params == preset.num_params
    arch = from_file.architecture
    assert arch is not None and (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (80, 8, 128)


def test_a_broken_config_json_is_one_line_naming_the_file(tmp_path, capsys):
    path = tmp_path / "broken" / "config.json"
    path.parent.mkdir()
    path.write_text("{not json")
    parser = argparse.ArgumentParser(prog="pagoda")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calc", "--model", str(path.parent), "--gpu", "h100-sxm"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagoda calc: {path}: not JSON (") and err.count("\n") == 1, err


def test_multimodal_configs_are_read_from_text_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llava", "text_config": MODEL_CONFIGS["llama-3-8b"]}))
    assert resolve_model(str(path)).num_params == 8_030_261_248


def test_mixture_of_experts_is_refused_rather_than_miscounted(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_3_70B_CONFIG, "num_local_experts": 8}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        resolve_model(str(path))


def test_parameter_counts_parse_with_suffixes():
    assert parse_param_count("70B") == 70e9
    assert parse_param_count("124.6m") == pytest.approx(124.6e6)
    assert parse_param_count("7e9") == 7e9
    assert parse_param_count("llama") is None


def test_gpu_presets_accept_their_printed_names():
    assert resolve_gpu("H100 SXM") is resolve_gpu("h100-sxm")
    assert resolve_gpu("RTX PRO 6000").memory_gb == 96
    assert resolve_gpu("a100_80gb").peak_tflops == 312  # dense, not the 624 sparse figure
    with pytest.raises(ValueError, match="unknown GPU"):
        resolve_gpu("h100-pcie-sparse")


def test_bytes_are_shown_in_both_gb_and_gib():
    assert format_bytes(140e9) == "140.0 GB = 130.4 GiB"
    assert format_bytes(327_680) == "327,680 B = 327.7 KB = 320.0 KiB"
    assert format_bytes(-68e9) == "-68.00 GB = 63.33 GiB"


# --- the CLI -------------------------------------------------------------------------------------


def test_70b_fp16_on_one_h100_is_flagged_and_still_given_figures(capsys):
    out = calc_json(capsys, "--model", "70B", "--gpu", "H100 SXM", "--dtype", "fp16")
    assert out["fits"] is False
    assert out["warnings"][0].startswith("DOES NOT FIT")
    assert out["memory"]["weight_bytes"] == 140e9
    assert out["memory"]["weights_fit"] is False
    assert out["decode"]["steps_per_s"] == pytest.approx(23.93, abs=0.01)


def test_llama_3_70b_kv_figures_through_the_cli(capsys):
    out = calc_json(capsys, "--model", "llama-3-70b", "--kv-dtype", "fp16", "--seq-len", "8192")
    assert out["memory"]["kv_bytes_per_token"] == 327_680
    assert out["memory"]["kv_bytes_per_sequence"] == 2_684_354_560


def test_quantized_kv_counts_as_the_engine_stores_it(capsys):
    """int8 KV is pagoda's format: a 4-byte scale per token and KV head beside the codes (the engine sizes its pool
    with the same function); fp8 has a scale per layer, nothing per token."""
    out = calc_json(capsys, "--model", "llama-3-70b", "--kv-dtype", "int8")
    assert out["memory"]["kv_bytes_per_token"] == 2 * 80 * 8 * (128 + 4)
    assert f.kv_bytes_per_token(80, 8, 128, "fp8") == f.kv_bytes_per_token(80, 8, 128, "fp16") / 2
    assert f.kv_bytes_per_token(30, 3, 64, "bf16") / f.kv_bytes_per_token(30, 3, 64, "int8") == 128 / 68


def test_custom_gpu_ridge_point(capsys):
    custom = ("--tflops", "990", "--tbps", "3.35", "--gpu-mem-gb", "80")
    out = calc_json(capsys, "--model", "llama-3-8b", *custom)
    assert out["setup"]["gpu"] == "custom"
    assert out["roofline"]["ridge_flop_per_byte"] == pytest.approx(295.5, abs=0.1)


def test_every_optional_section_reproduces_its_worked_example(capsys):
    out = calc_json(
        capsys,
        "--model", "llama-3-8b", "--gpu", "h100-sxm",
        "--price-per-hour", "3", "--tokens-per-s", "5000",
        "--spec-alpha", "0.8", "--spec-k", "5",
        "--prompt-len", "2000", "--prefix-len", "1800", "--block-size", "16",
        "--token-budget", "2048", "--running-decodes", "100",
    )  # fmt: skip
    assert round(out["cost"]["dollars_per_million_tokens"], 3) == 0.167
    assert round(out["speculative"]["expected_tokens_per_step"], 3) == 3.689
    assert out["prefix_cache"]["reusable_tokens"] == 1792
    assert out["chunked_prefill"]["steps"] == 2  # this prompt is 2,000 tokens
    assert 0 < out["utilization"]["mfu"] < 1


def test_decode_table_marks_batches_that_do_not_fit(capsys):
    out = calc_json(capsys, "--model", "llama-3-70b", "--num-gpus", "4", "--seq-len", "8192", "--batch", "32")
    max_sequences = out["memory"]["max_sequences"]
    rows = {row["batch"]: row for row in out["decode_by_batch"]}
    assert rows[max_sequences]["fits"] is True
    assert all(row["fits"] is False for batch, row in rows.items() if batch > max_sequences)
    assert rows[1]["tokens_per_s_per_user"] > rows[512]["tokens_per_s_per_user"]
    assert rows[512]["tokens_per_s_per_gpu"] > rows[1]["tokens_per_s_per_gpu"]


def test_tensor_parallel_all_reduce_bytes(capsys):
    out = calc_json(capsys, "--model", "llama-3-70b", "--num-gpus", "8")
    tp = out["tensor_parallel"]
    assert tp["allreduce_payload_bytes_per_token"] == 2 * 80 * 8192 * 2
    assert tp["wire_bytes_per_token_per_gpu"] == pytest.approx(2 * 7 / 8 * 2 * 80 * 8192 * 2)
    assert out["memory"]["kv_bytes_per_token_per_gpu"] == 2 * 80 * 1 * 128 * 2  # 8 KV heads over 8 GPUs


def test_all_reduce_latency_is_paid_per_layer_at_any_batch(capsys):
    """70B on 8 H100s: 160 all-reduces of 2 x 7 hops at the preset's 1.5 µs each, 3.36 ms a step."""
    out = calc_json(capsys, "--model", "llama-3-70b", "--num-gpus", "8")
    tp = out["tensor_parallel"]
    assert tp["allreduces_per_step"] == 160
    assert tp["allreduce_latency_s"] == pytest.approx(14 * 1.5e-6)
    assert tp["comm_latency_s_per_step"] == pytest.approx(160 * 14 * 1.5e-6)
    assert tp["comm_latency_s_per_step"] > 100 * tp["comm_bandwidth_s_per_step"]  # batch 1: latency-bound
    batch_256 = calc_json(capsys, "--model", "llama-3-70b", "--num-gpus", "8", "--batch", "256")["tensor_parallel"]
    assert batch_256["comm_latency_s_per_step"] == tp["comm_latency_s_per_step"]
    assert batch_256["comm_bandwidth_s_per_step"] == pytest.approx(256 * tp["comm_bandwidth_s_per_step"])
    measured = calc_json(capsys, "--model", "llama-3-70b", "--gpu", "h100-sxm", "--num-gpus", "8",
                         "--interconnect-latency-us", "0")
    assert measured["tensor_parallel"]["comm_latency_s_per_step"] == 0
    assert measured["decode"]["step_s"] < out["decode"]["step_s"]


def test_the_tp_table_shows_when_splitting_pays(capsys):
    out = calc_json(capsys, "--model", "llama-3-70b", "--gpu", "h100-sxm", "--num-gpus", "3")
    rows = {row["num_gpus"]: row for row in out["tp_scaling"]}
    assert sorted(rows) == [1, 2, 3, 4, 8]
    assert rows[1]["fits"] is False and rows[2]["fits"] is True  # 141 GB of bf16 weights, 72 GB usable a GPU
    assert rows[1]["comm_fraction_of_step"] == 0
    for smaller, larger in ((1, 2), (2, 4), (4, 8)):
        assert rows[larger]["weight_bytes_per_gpu"] == pytest.approx(rows[smaller]["weight_bytes_per_gpu"] / 2)
        assert rows[larger]["tokens_per_s_per_user"] > rows[smaller]["tokens_per_s_per_user"]
        assert rows[larger]["tokens_per_s_per_gpu"] < rows[smaller]["tokens_per_s_per_gpu"]
        assert rows[larger]["comm_fraction_of_step"] > rows[smaller]["comm_fraction_of_step"]
    assert rows[3]["step_s"] == pytest.approx(out["decode"]["step_s"])


def test_table_output_shows_units_and_the_warning(capsys):
    assert cli.main(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--seq-len", "8192"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("!! DOES NOT FIT")
    assert "2.684 GB = 2.500 GiB" in text
    assert "Decode ceiling by batch" in text


def test_this_machine_is_measured_and_labelled(capsys, monkeypatch):
    from pagoda.calc import measure

    measured = measure.measure_this_machine(read_bytes=4 * measure.MiB, matmul_size=64)
    assert measured.peak_flops > 0 and measured.bandwidth > 0 and "measured" in measured.source
    monkeypatch.setattr(measure, "measure_this_machine", lambda: measured)
    out = calc_json(capsys, "--model", "bench-125m", "--gpu", "this-machine")
    assert out["setup"]["gpu"] == "this machine"
    assert out["setup"]["peak_flop_per_s"] == measured.peak_flops


def test_bad_input_is_an_error_message_not_a_traceback(capsys):
    assert cli.main(["--gpu", "tpu-v9"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert cli.main(["--tflops", "100"]) == 2
    assert "--tbps, --gpu-mem-gb" in capsys.readouterr().err
    assert cli.main(["--dtype", "fp12"]) == 2
    assert cli.main(["--spec-alpha", "1.5"]) == 2


def test_list_presets(capsys):
    assert cli.main(["--list-presets"]) == 0
    text = capsys.readouterr().out
    assert "h100-sxm" in text and "llama-3-70b" in text


def test_calc_does_not_import_torch():
    code = "import sys, pagoda.calc.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_gpu_spec_units():
    gpu = GpuSpec("x", peak_tflops=1.0, bandwidth_tbps=2.0, memory_gb=3.0)
    assert (gpu.peak_flops, gpu.bandwidth, gpu.memory_bytes) == (1e12, 2e12, 3e9)


def test_int4_bytes_include_group_scales_and_offsets():
    """pagoda's int4 stores a bf16 scale and offset per group: 5 bits a weight at 32, 4.25 at 128."""
    assert f.dtype_bytes("int4") == 0.5 + 4 / 32
    assert f.dtype_bytes("int4-g128") == 0.5 + 4 / 128
    assert f.weight_bytes(1e9, "int4") == 0.625e9
