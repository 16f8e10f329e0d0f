"""The engine's options reach EngineConfig the same way from every surface: the config classes, which alone
write the defaults; `build_engine_config` (behind `LLM(...)`); and the CLI's flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagoda.cli import build_parser
from pagoda.config import (
    CacheConfig,
    EngineConfig,
    Int4Options,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagoda.engine_args import engine_config_from
from pagoda.entrypoints import ENGINE_OPTIONS, FIELD_NAMES, build_engine_config
from pagoda.structured.limits import GrammarLimits

MODEL = "some/model-dir"

# One value per option, none of them its default.
OPTIONS = {
    "dtype": "bfloat16",
    "device": "meta",
    "seed": 7,
    "quantization": "int4",
    "quantization_config": {"group_size": 64, "sym": True, "lm_head": False, "search": False},
    "use_kernels": False,
    "block_size": 32,
    "kv_cache_memory_bytes": 3 << 20,
    "num_kv_blocks": 100,
    "enable_prefix_caching": False,
    "kv_cache_dtype": "fp8",
    "calculate_kv_scales": True,
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 1024,
    "max_step_ms": 50.0,
    "long_prefill_token_threshold": 256,
    "scheduling_policy": "priority",
    "priority_aging_s": 2.5,
    "batching": "static",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 4, "disable_by_batch_size": 8},
    # Each grammar limit at twice its default.
    **{f"grammar_{f.name}": 2 * f.default for f in dataclasses.fields(GrammarLimits)},
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "enable_expert_parallel": True,
    "enable_eplb": False,  # True is refused (not built)
    "cpu_threads_bind": "nobind",
    "cpu_threads_adapt": False,
    "enable_lora": True,
    "max_loras": 2,
    "max_cpu_loras": 3,
    "max_lora_rank": 32,
    "kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}},
    "runner": "pooling",
    "convert": "embed",
}
# vLLM's shorthand for a kv_transfer_config (an OffloadingConnector of that many GiB): refused beside one.
KV_OFFLOADING_SHORTHAND = {"kv_offloading_size", "kv_offloading_backend"}
FLAGS = [
    "--dtype", "bfloat16", "--device", "meta", "--seed", "7", "--quantization", "int4",
    "--quantization-config", json.dumps(OPTIONS["quantization_config"]), "--no-use-kernels",
    "--block-size", "32", "--kv-cache-memory-bytes", "3M", "--num-kv-blocks", "100",
    "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--max-model-len", "512",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "1024", "--max-step-ms", "50", "--long-prefill-token-threshold", "256",
    "--scheduling-policy", "priority", "--priority-aging-s", "2.5", "--batching", "static",
    "--speculative-config", json.dumps(OPTIONS["speculative_config"]),
    *[text for f in dataclasses.fields(GrammarLimits) for text in (f"--grammar-{f.name.replace('_', '-')}",
                                                                    str(2 * f.default))],
    "-tp", "2", "-pp", "2", "--distributed-executor-backend", "mp", "--enable-expert-parallel",
    "--cpu-threads-bind", "nobind", "--no-cpu-threads-adapt",
    "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "32",
    "--kv-transfer-config", json.dumps(OPTIONS["kv_transfer_config"]),
    "--runner", "pooling", "--convert", "embed",
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
    assert given.dtype == "bfloat16"
    assert given.quantization_config == Int4Options(group_size=64, sym=True, lm_head=False, search=False)
    assert given.cache == CacheConfig(block_size=32, kv_cache_memory_bytes=3 << 20, num_blocks=100,
                                      enable_prefix_caching=False, cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    assert given.scheduler == SchedulerConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=1024,
                                              max_step_ms=50.0, long_prefill_token_threshold=256,
                                              scheduling_policy="priority", priority_aging_s=2.5, batching="static")
    assert given.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                                                         prompt_lookup_max=4, disable_by_batch_size=8)
    assert given.grammar == GrammarLimits(**{f.name: 2 * f.default for f in dataclasses.fields(GrammarLimits)})
    assert given.parallel == ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                                            distributed_executor_backend="mp", enable_expert_parallel=True,
                                            cpu_threads_bind="nobind", cpu_threads_adapt=False)
    assert given.lora == LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=32)
    assert given.runner == "pooling"


@pytest.mark.parametrize("dtype", ["bf16", "BFloat16", torch.bfloat16])
def test_a_dtype_is_held_by_its_name_whether_given_as_alias_name_or_torch_dtype(dtype):
    assert build_engine_config(MODEL, dtype=dtype).dtype == "bfloat16"


def test_an_unknown_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown dtype 'float8'.*'bf16', 'bfloat16'"):
        build_engine_config(MODEL, dtype="float8")
    with pytest.raises(ValueError, match="EngineConfig.dtype must be one of"):
        EngineConfig(model=MODEL, dtype="bf16")  # the config holds names only, never aliases


def test_every_config_field_has_an_option():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "cache", "scheduler", "grammar", "parallel"}
    fields |= {f.name for f in dataclasses.fields(ParallelConfig)}
    fields |= {f.name for f in dataclasses.fields(CacheConfig)}
    fields |= {f.name for f in dataclasses.fields(GrammarLimits)}
    fields |= {f.name for f in dataclasses.fields(SchedulerConfig)}
    fields |= {f.name for f in dataclasses.fields(LoRAConfig)}  # and `lora` itself, which enable_lora sets
    assert {FIELD_NAMES.get(name, name) for name in ENGINE_OPTIONS} - KV_OFFLOADING_SHORTHAND == fields
    assert set(OPTIONS) | KV_OFFLOADING_SHORTHAND == set(ENGINE_OPTIONS)


def test_the_kv_offloading_shorthand_is_the_same_connector_from_llm_and_from_the_cli():
    given = build_engine_config(MODEL, kv_offloading_size=0.5, kv_offloading_backend="native")
    assert cli_config("serve", "--kv-offloading-size", "0.5", "--kv-offloading-backend", "native") == given
    assert given.kv_transfer_config is not None
    assert given.kv_transfer_config.kv_connector_extra_config == {"cpu_bytes_to_use": 1 << 29}


@pytest.mark.parametrize("option", ["block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_sizes_must_be_positive_whichever_surface_gives_them(option):
    with pytest.raises(ValueError, match=f"{option} must be positive"):
        build_engine_config(MODEL, **{option: 0})
    with pytest.raises(ValueError, match=f"{option} must be positive"):
        cli_config("serve", f"--{option.replace('_', '-')}", "0")


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="max_batch_size"):
        build_engine_config(MODEL, max_batch_size=4)


def spec_from_every_surface(options: dict) -> list[SpeculativeConfig | None]:
    """The SpeculativeConfig that LLM(...) and `pagoda serve` / `generate` make of one JSON object."""
    flags = ["--speculative-config", json.dumps(options)]
    return [build_engine_config(MODEL, speculative_config=options).speculative_config,
            cli_config("serve", *flags).speculative_config, cli_config("generate", *flags).speculative_config]


@pytest.mark.parametrize(("given", "lookup"), [
    ({}, (5, 5)),  # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),  # one given: the other takes its value
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_speculative_config_resolves_vllms_lookup_defaults_the_same_everywhere(given, lookup):
    options = {"method": "ngram", "num_speculative_tokens": 2, **given}
    for config in spec_from_every_surface(options):
        assert config is not None and (config.prompt_lookup_min, config.prompt_lookup_max) == lookup
        assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=2,
                                           prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
        assert config.disable_by_batch_size is None


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported yet"),
    ({"model": "some/draft", "num_speculative_tokens": 3}, 'a draft model needs "method": "draft_model"'),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be positive"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max .* at least prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must be positive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size must be positive"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     "unsupported key.*draft_tensor_parallel_size"),
])
def test_bad_speculative_configs_are_refused_at_start_up_by_every_surface(options, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config(MODEL, speculative_config=options)
    with pytest.raises(ValueError, match=message):
        cli_config("serve", "--speculative-config", json.dumps(options))


def test_speculative_config_flag_takes_only_a_json_object(capsys):
    for text in ("not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            cli_config("serve", "--speculative-config", text)
        assert "--speculative-config" in capsys.readouterr().err


def test_lora_options_need_enable_lora_and_max_cpu_loras_holds_max_loras():
    assert build_engine_config(MODEL).lora is None
    assert build_engine_config(MODEL, enable_lora=True).lora == LoRAConfig(max_loras=1, max_lora_rank=16)
    with pytest.raises(ValueError, match="max_loras apply to LoRA adapters only: give enable_lora=True"):
        build_engine_config(MODEL, max_loras=2)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        build_engine_config(MODEL, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be positive"):
        cli_config("serve", "--enable-lora", "--max-lora-rank", "0")
