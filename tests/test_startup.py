"""Start-up: the KV pool is the size the model can use and is never read before it is written; the built-in
model's served name; `generate` through the chat template; the summary; and a --model pagoda cannot load
(a hub id, a GGUF file) answered with what it needs, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_fixtures import make_server_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.cli import build_parser, main
from pagoda.config import CacheConfig
from pagoda.demo import DEMO_MODEL_DIR
from pagoda.engine.kv_pool import kv_pool_size
from pagoda.engine_args import model_to_load, served_model_name
from pagoda.kernels import available_targets
from pagoda.startup import native_kernels_status, startup_summary
from pagoda.text.tokenizer import encode_chat

KIB = 1 << 10

# --------------------------------------------------------------------------------------------------
# The KV pool
# --------------------------------------------------------------------------------------------------


def test_the_pool_holds_max_num_seqs_sequences_of_max_model_len_in_whole_blocks():
    pool = kv_pool_size(CacheConfig(block_size=16), max_num_seqs=8, max_model_len=100, bytes_per_token=KIB)
    assert pool.num_blocks == 8 * 7  # 100 tokens take 7 blocks of 16
    assert pool.reason == "max_num_seqs 8 x max_model_len 100 tokens"


def test_the_memory_budget_caps_the_pool():
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=20 * 16 * KIB)  # room for 20 blocks
    pool = kv_pool_size(cache, max_num_seqs=8, max_model_len=100, bytes_per_token=KIB)
    assert pool.num_blocks == 20
    assert pool.reason.startswith("capped by kv_cache_memory_bytes") and "56 blocks" in pool.reason


def test_an_explicit_block_count_is_taken_as_given():
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=16 * KIB, num_blocks=300)
    assert kv_pool_size(cache, max_num_seqs=8, max_model_len=100, bytes_per_token=KIB).num_blocks == 300


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(str(DEMO_MODEL_DIR))  # every default: the pool sizes itself


def test_the_built_in_model_gets_the_pool_it_can_use_not_the_whole_budget(demo_llm):
    engine = demo_llm.engine
    context = engine.model_config.max_position_embeddings  # 512, below the default max_model_len
    assert engine.max_model_len == context
    blocks = engine.config.scheduler.max_num_seqs * context // engine.config.cache.block_size
    assert engine.kv_cache.num_blocks == blocks
    assert engine.kv_pool_bytes == blocks * engine.config.cache.block_size * engine.model_config.kv_bytes_per_token(
        engine.config.dtype) < engine.config.cache.kv_cache_memory_bytes


def llama_parameters(config_path: Path) -> int:
    """A Llama's weight count from its config alone: tied embeddings, per layer q/k/v/o, SwiGLU and two norms."""
    c = json.loads(config_path.read_text())
    assert c["tie_word_embeddings"] and not c["attention_bias"] and not c["mlp_bias"]
    hidden, q, kv = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * c["intermediate_size"] + 2 * hidden
    return c["vocab_size"] * hidden + c["num_hidden_layers"] * layer + hidden


def test_the_engine_describes_itself_as_built(demo_llm):
    engine = demo_llm.engine
    description = engine.describe()
    assert (description.model, description.dtype) == (str(DEMO_MODEL_DIR), "float32")
    assert description.quantized_matmul is None
    assert description.num_parameters == llama_parameters(DEMO_MODEL_DIR / "config.json") == 4_623_616  # "4.6M"
    assert description.max_model_len == engine.max_model_len == 512
    assert description.num_threads == torch.get_num_threads()
    kv = description.kv_cache
    assert (kv.num_blocks, kv.block_size, kv.num_bytes) == (4096, 16, engine.kv_pool_bytes)
    assert kv.sizing_reason.startswith("max_num_seqs 128 x max_model_len 512") and kv.enable_prefix_caching


def test_attention_never_reads_a_slot_it_has_not_written(make_llm, checkpoint):
    """The pool is not zero-filled: filled with NaN, it must give what a zeroed pool gives, with decodes of
    different lengths batched together (the shorter ones padded) and prefix-cache hits."""
    prompts = [[5 + i for i in range(length)] for length in (3, 17, 30, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(fill: float) -> list[list[int]]:
        llm = make_llm(checkpoint("llama"), num_kv_blocks=64, block_size=4)
        for kv in llm.engine.runner.kv_caches:
            kv.k.fill_(fill)
            kv.v.fill_(fill)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[::-1], params, use_tqdm=False)[::-1]  # prompts now hit the prefix cache
        return [out.outputs[0].token_ids for out in first + again]

    with_nan = generate(float("nan"))
    assert with_nan == generate(0.0)
    assert all(len(tokens) == 12 for tokens in with_nan)


# --------------------------------------------------------------------------------------------------
# Names, generate, the summary
# --------------------------------------------------------------------------------------------------


def served_name(*flags: str) -> str:
    """The name `pagoda serve` with these flags lists in /v1/models."""
    args = build_parser().parse_args(["serve", *flags])
    return served_model_name(model_to_load(args.model, "serve"), args.served_model_name)


def test_the_built_in_model_is_served_as_pagoda_demo(tmp_path):
    assert served_name() == "pagoda-demo"
    assert served_name("--model", str(DEMO_MODEL_DIR)) == "pagoda-demo"
    assert served_name("--served-model-name", "mine") == "mine"
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert served_name("--model", str(other)) == str(other)


def test_generate_with_only_a_prompt_answers_through_the_chat_template(demo_llm):
    question = "What is 12 + 35?"
    result = subprocess.run([sys.executable, "-m", "pagoda", "generate", question], capture_output=True, text=True,
                            timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert result.returncode == 0, result.stderr
    prompt = encode_chat(demo_llm.get_tokenizer(), [{"role": "user", "content": question}])
    expected = demo_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert result.stdout.strip() == expected.outputs[0].text.strip()
    assert result.stdout.strip().isdigit()  # the built-in model answers arithmetic with a number
    assert "chat template" in result.stderr and "Traceback" not in result.stderr


def test_generate_raw_says_it_completes_the_plain_prompt(capsys):
    assert main(["generate", "--raw", "--max-tokens", "2", "--num-kv-blocks", "16", "What is"]) == 0
    assert "plain completion (--raw)" in capsys.readouterr().err


def test_generate_completes_plainly_for_a_model_without_a_chat_template(tmp_path, capsys):
    model_dir = make_server_checkpoint(tmp_path, chat_template=False)
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "2", "--num-kv-blocks", "16", "hi"]) == 0
    assert "plain completion (the model has no chat template)" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--chat", "--num-kv-blocks", "16", "hi"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_generate_refuses_chat_and_raw_together(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--chat", "--raw", "hi"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_summary_says_what_runs(demo_llm):
    engine = demo_llm.engine
    summary = startup_summary(engine.describe(), engine.config, "pagoda-demo", "http://127.0.0.1:8000")
    rows = dict(line.strip().split("  ", 1) for line in summary.splitlines())
    rows = {name: value.strip() for name, value in rows.items()}
    assert rows["model"] == f"pagoda-demo ({DEMO_MODEL_DIR})"
    assert rows["parameters"] == "4.6M"
    assert rows["dtype"] == "float32" and rows["quantization"] == "none"
    assert rows["KV cache"].startswith(
        "4096 blocks x 16 tokens = 65536 tokens, float32, 192.0 MiB (max_num_seqs 128 x ")
    assert rows["max_model_len"] == "512"
    assert rows["threads"] == str(torch.get_num_threads())
    assert rows["native kernels"] == native_kernels_status(demo_llm.engine.config)
    assert rows["URL"].startswith("http://127.0.0.1:8000")


def test_native_kernels_say_why_they_are_off(demo_llm, monkeypatch):
    from dataclasses import replace

    config = demo_llm.engine.config
    assert native_kernels_status(replace(config, use_kernels=False)) == "off: --no-use-kernels"
    monkeypatch.setenv("PAGODA_SIMD_TARGET", "sve")
    assert native_kernels_status(config) == (
        "off: PAGODA_SIMD_TARGET=sve is not a target (avx512, avx512f, avx2, neon); torch path")


@pytest.mark.parametrize("machine,flags,forced,expected,available", [
    ("aarch64", set(), None, ("neon", "the best this CPU has"), ["neon"]),
    ("aarch64", set(), "avx2", (None, "PAGODA_SIMD_TARGET=avx2, but it is for amd64/x86_64, this machine is aarch64"),
     ["neon"]),
    ("x86_64", {"avx2", "fma"}, None,
     ("avx2", "the CPU lacks avx512_bf16, avx512_vnni, avx512bw, avx512f, avx512vbmi for avx512"), ["avx2"]),
    ("x86_64", {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, None,  # Cascade Lake
     ("avx2", "the CPU lacks avx512_bf16, avx512vbmi for avx512"), ["avx512f", "avx2"]),
    ("x86_64", {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512f",
     ("avx512f", "PAGODA_SIMD_TARGET=avx512f"), ["avx512f", "avx2"]),
    ("x86_64", {"sse4_2"}, None, (None, "the CPU lacks avx2, fma for avx2"), []),
    ("x86_64", {"avx2", "fma"}, "neon",
     (None, "PAGODA_SIMD_TARGET=neon, but it is for aarch64/arm64, this machine is x86_64"), ["avx2"]),
])
def test_each_machine_picks_among_its_own_targets(monkeypatch, machine, flags, forced, expected, available):
    import pagoda.kernels

    monkeypatch.setattr(pagoda.kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(pagoda.kernels.platform, "machine", lambda: machine)
    if forced:
        monkeypatch.setenv("PAGODA_SIMD_TARGET", forced)
    else:
        monkeypatch.delenv("PAGODA_SIMD_TARGET", raising=False)
    assert pagoda.kernels.simd_target() == expected
    assert pagoda.kernels.available_targets() == available


def test_native_kernels_say_which_target_runs_and_why(demo_llm, monkeypatch):
    config = demo_llm.engine.config
    best = available_targets()[0]
    reason = "the best this CPU has" if best == "avx512" else "the CPU lacks avx512_bf16, "
    assert native_kernels_status(config).startswith(f"on: {best} ({reason}")
    monkeypatch.setenv("PAGODA_SIMD_TARGET", "avx2")
    assert native_kernels_status(config) == "on: avx2 (PAGODA_SIMD_TARGET=avx2)"
    if "avx512" not in available_targets():
        monkeypatch.setenv("PAGODA_SIMD_TARGET", "avx512")
        assert native_kernels_status(config).startswith("off: PAGODA_SIMD_TARGET=avx512, but the CPU lacks avx512_bf16")


# --------------------------------------------------------------------------------------------------
# A --model pagoda cannot load
# --------------------------------------------------------------------------------------------------


def test_a_hub_id_is_answered_with_how_to_download_it():
    result = subprocess.run([sys.executable, "-m", "pagoda", "serve", "--model", "meta-llama/Llama-3.2-1B"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "hf download meta-llama/Llama-3.2-1B --local-dir models/Llama-3.2-1B" in result.stderr
    assert "config.json" in result.stderr and "safetensors" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_gguf_file_is_answered_with_what_pagoda_reads(tmp_path, capsys, command):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    extra = ["a prompt"] if command == "generate" else []
    with pytest.raises(SystemExit) as exited:
        main([command, "--model", str(gguf), *extra])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"pagoda {command}: {gguf} is a GGUF file" in error and "safetensors" in error


def test_a_directory_without_config_json_says_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", str(tmp_path)])
    assert exited.value.code == 2
    assert f"{tmp_path}: no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("dtype,flags,machine,warned", [
    ("float16", {"avx2", "fma"}, "x86_64", True),
    ("float16", {"avx2", "avx512f", "avx512_fp16"}, "x86_64", False),
    ("float16", {"avx2", "amx_fp16"}, "x86_64", False),
    ("float32", {"avx2", "fma"}, "x86_64", False),
    ("float16", set(), "aarch64", False),  # flags read from x86's /proc/cpuinfo only: no claim elsewhere
])
def test_float16_on_a_cpu_without_native_fp16_warns_with_the_faster_choice(monkeypatch, caplog, dtype, flags,
                                                                          machine, warned):
    import logging

    import pagoda.kernels
    from pagoda.engine_args import engine_config_from

    monkeypatch.setattr(pagoda.kernels, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(pagoda.kernels.platform, "machine", lambda: machine)
    args = build_parser().parse_args(["generate", "hi", "--dtype", dtype])
    args.model = str(DEMO_MODEL_DIR)
    with caplog.at_level(logging.WARNING, logger="pagoda"):
        assert engine_config_from(args).dtype == dtype
    warnings = [record.getMessage() for record in caplog.records if record.name == "pagoda"]
    if warned:
        assert len(warnings) == 1 and "--dtype float32 is faster" in warnings[0], warnings
    else:
        assert not warnings
