"""The engine's options reach EngineConfig the same way from every surface: the config classes, which alone
write the defaults; `build_engine_config` (behind `LLM(...)`); and the CLI's flags."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.cli import build_parser, engine_config_from
from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig
from pagoda.entrypoints import ENGINE_OPTIONS, FIELD_NAMES, build_engine_config

MODEL = "some/model-dir"

# One value per option, none of them its default.
OPTIONS = {
    "dtype": "bfloat16",
    "device": "meta",
    "seed": 7,
    "quantization": "int8",
    "use_kernels": False,
    "block_size": 32,
    "kv_cache_memory_bytes": 3 << 20,
    "num_kv_blocks": 100,
    "enable_prefix_caching": False,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 1024,
}
FLAGS = [
    "--dtype", "bfloat16", "--device", "meta", "--seed", "7", "--quantization", "int8", "--no-use-kernels",
    "--block-size", "32", "--kv-cache-memory-bytes", "3M", "--num-kv-blocks", "100",
    "--no-enable-prefix-caching", "--max-model-len", "512", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "1024",
]


def cli_config(command: str, *flags: str) -> EngineConfig:
    extra = ["a prompt"] if command == "generate" else []
    args = build_parser().parse_args([command, "--model", MODEL, *flags, *extra])
    return engine_config_from(args)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_defaults_agree_across_the_cli_build_engine_config_and_the_config_classes(command):
    expected = EngineConfig(model=MODEL)
    assert build_engine_config(MODEL) == expected
    assert cli_config(command) == expected


def test_every_option_sets_the_same_field_from_llm_and_from_the_cli():
    given = build_engine_config(MODEL, **OPTIONS)
    assert cli_config("serve", *FLAGS) == given
    assert given.dtype == torch.bfloat16
    assert given.cache == CacheConfig(block_size=32, kv_cache_memory_bytes=3 << 20, num_blocks=100,
                                      enable_prefix_caching=False)
    assert given.scheduler == SchedulerConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024)


def test_every_config_field_has_an_option():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "cache", "scheduler"}
    fields |= {f.name for f in dataclasses.fields(CacheConfig)}
    fields |= {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert {FIELD_NAMES.get(name, name) for name in ENGINE_OPTIONS} == fields
    assert set(OPTIONS) == set(ENGINE_OPTIONS)


@pytest.mark.parametrize("option", ["block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_sizes_must_be_positive_whichever_surface_gives_them(option):
    with pytest.raises(ValueError, match=f"{option} must be positive"):
        build_engine_config(MODEL, **{option: 0})
    with pytest.raises(ValueError, match=f"{option} must be positive"):
        cli_config("serve", f"--{option.replace('_', '-')}", "0")


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="max_batch_size"):
        build_engine_config(MODEL, max_batch_size=4)
