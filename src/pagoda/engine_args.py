"""The engine's command-line flags (vLLM's names) and what they load: shared by `pagoda serve`, `generate` and
`chat`. Importing this module imports no torch, so `--help` answers at once."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from pagoda.flag_values import format_bytes, json_object, parse_bytes, show_default

if TYPE_CHECKING:
    from pagoda.config import EngineConfig


def default_model() -> str:
    """The demo model that ships inside the package (see pagoda.demo)."""
    from pagoda.demo import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR)


# The name the built-in model is served under, wherever the package is installed.
DEMO_SERVED_NAME = "pagoda-demo"


def model_to_load(model: str | None, command: str) -> str:
    """The --model to load: the built-in model when none is given. Anything but a local checkpoint directory
    (a hub id, a GGUF file) ends the command here, exit 2, saying what pagoda needs and how to get it."""
    if model is None:
        return default_model()
    from pagoda.model_dir import ModelLoadError, check_model_dir

    try:
        check_model_dir(model)
    except ModelLoadError as error:
        print(f"pagoda {command}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    return model


def is_builtin_model(model: str) -> bool:
    from pathlib import Path

    return Path(model).resolve() == Path(default_model()).resolve()


def served_model_name(model: str, given: str | None = None) -> str:
    """The name given (--served-model-name), else `pagoda-demo` for the built-in model, else --model as written."""
    if given:
        return given
    return DEMO_SERVED_NAME if is_builtin_model(model) else model


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, with vLLM's names. Each defaults to None, "not given": build_engine_config fills in
    pagoda.config's defaults, and each help shows the default read from there (pagoda.config is torch-free)."""
    from pagoda.config import (
        BATCHING_MODES,
        CPU_THREADS_BIND,
        DISTRIBUTED_EXECUTOR_BACKENDS,
        DTYPE_BYTES,
        SCHEDULING_POLICIES,
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from pagoda.int4_format import Int4Options
    from pagoda.kv_format import KV_CACHE_DTYPES

    int4_defaults = json.dumps({key: getattr(Int4Options, key) for key in Int4Options.KEYS})
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: built-in)")
    parser.add_argument("--dtype", help=f"{' | '.join(DTYPE_BYTES)} (default {EngineConfig.dtype})")
    parser.add_argument("--device", help=f"default {EngineConfig.device}")
    parser.add_argument("--quantization", "-q", choices=["int8", "int4"],
                        help="weight-only, quantized at load: int8 (per output channel, symmetric) or int4 "
                             "(group-wise); a GPTQ or AWQ checkpoint is int4 already (docs/quantization.md)")
    parser.add_argument("--quantization-config", type=json_object,
                        help=f"int4 options: '{int4_defaults}' (those are the defaults)")
    parser.add_argument("--use-kernels", action=argparse.BooleanOptionalAction,
                        help="pagoda's native CPU kernels (compiled on first use) where they apply "
                             f"(default {show_default(EngineConfig.use_kernels)})")
    parser.add_argument("--seed", type=int, help=f"default {EngineConfig.seed}")
    parser.add_argument("--max-model-len", type=int, help=f"default {SchedulerConfig.max_model_len}")
    parser.add_argument("--max-num-seqs", type=int, help=f"default {SchedulerConfig.max_num_seqs}")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help=f"default {SchedulerConfig.max_num_batched_tokens}")
    parser.add_argument("--max-step-ms", type=float,
                        help="while requests decode, cap each step's prefill so the step is predicted to take at "
                             f"most this long (default {show_default(SchedulerConfig.max_step_ms)}; 0: no cap; "
                             "docs/scheduling.md)")
    parser.add_argument("--long-prefill-token-threshold", type=int,
                        help="most prefill tokens one request computes per step "
                             f"(default {SchedulerConfig.long_prefill_token_threshold}; 0: no cap)")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                        help="fcfs, or priority: the request's `priority`, lower first "
                             f"(default {SchedulerConfig.scheduling_policy})")
    parser.add_argument("--priority-aging-s", type=float,
                        help="priority: each level counts as this many seconds of later arrival, bounding how "
                             f"long lower levels wait (default {show_default(SchedulerConfig.priority_aging_s)}; "
                             "0: strict order, no bound)")
    parser.add_argument("--batching", choices=BATCHING_MODES,
                        help="continuous (the default), or static, for teaching only: a new batch starts once "
                             "the whole previous batch has finished (docs/labs.md)")
    parser.add_argument("--block-size", type=int, help=f"default {CacheConfig.block_size}")
    parser.add_argument("--kv-cache-memory-bytes", type=parse_bytes,
                        help="most bytes the KV pool may take (suffixes K, M, G: 2G = 2 GiB; "
                             f"default {format_bytes(CacheConfig.kv_cache_memory_bytes)}); the pool is what "
                             "--max-num-seqs x --max-model-len can use, up to this")
    parser.add_argument("--num-kv-blocks", type=int, help="explicit pool size in blocks")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        help=f"default {show_default(CacheConfig.enable_prefix_caching)}")
    # The names normalised by the type (fp8 is fp8_e4m3), which refuses the fp8 forms pagoda does not store by name.
    parser.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, choices=("auto", "fp8_e4m3", "int8"),
                        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                        help="the KV cache's storage: auto (the model's dtype), fp8 (= fp8_e4m3, a scale per "
                             "layer) or int8 (a scale per token and KV head); fp8 and int8 hold ~2x the tokens "
                             f"of bf16 (default {CacheConfig.cache_dtype}; docs/kv-cache.md)")
    parser.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                        help="fp8 KV: each layer's K and V scales from the first K/V written (amax / 448), "
                             f"not 1.0 (default {show_default(CacheConfig.calculate_kv_scales)})")
    parser.add_argument("--speculative-config", type=json_object,
                        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": PATH, '
                             '"num_speculative_tokens": 3}\' (docs/speculative.md)')
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        help="processes each layer is split across, one rank each, on this machine "
                             f"(default {ParallelConfig.tensor_parallel_size}; docs/parallelism.md)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int,
                        help="stages the layers are split into, contiguous, each on --tensor-parallel-size "
                             f"processes (default {ParallelConfig.pipeline_parallel_size}; docs/parallelism.md)")
    parser.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS,
                        help="mp: pagoda starts the ranks as processes; uni: one process (default: mp when "
                             "there are several ranks, else uni); external_launcher: torchrun or Kubernetes "
                             "started one process a rank (docs/parallelism.md)")
    parser.add_argument("--cpu-threads-bind", choices=CPU_THREADS_BIND,
                        help="auto: each rank pagoda starts runs on CPUs of its own, where the machine has "
                             "enough for every rank's threads; nobind: the OS places them (default "
                             f"{ParallelConfig.cpu_threads_bind}; docs/parallelism.md)")
    parser.add_argument("--cpu-threads-adapt", action=argparse.BooleanOptionalAction,
                        help="run a step with fewer threads while that is faster (another process busy on a "
                             "core), probing now and then whether more are faster again (default "
                             f"{show_default(ParallelConfig.cpu_threads_adapt)}; docs/performance.md)")
    parser.add_argument("--enable-expert-parallel", action="store_true", default=None,
                        help="a mixture of experts: its experts placed across the --tensor-parallel-size ranks, "
                             "tokens sent to them and back with all-to-all (docs/moe.md)")
    parser.add_argument("--enable-eplb", action="store_true", default=None,
                        help="vLLM's expert load balancing: not built (refused)")
    parser.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve LoRA adapters (PEFT directories) beside the base model (docs/lora.md)")
    parser.add_argument("--max-loras", type=int,
                        help=f"LoRA adapters one step may hold (default {LoRAConfig.max_loras})")
    parser.add_argument("--max-cpu-loras", type=int,
                        help="LoRA adapters kept loaded, least recently used dropped beyond (default: --max-loras)")
    parser.add_argument("--max-lora-rank", type=int,
                        help=f"highest LoRA rank an adapter may have (default {LoRAConfig.max_lora_rank})")
    parser.add_argument("--kv-transfer-config", type=json_object,
                        help='the KV connector, vLLM\'s JSON: \'{"kv_connector": "OffloadingConnector", "kv_role": '
                             '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296, '
                             '"shared_store": "redis://host:6379/0"}}\' (docs/kv-offload.md)')
    parser.add_argument("--kv-offloading-size", type=float,
                        help="GiB of host memory for offloaded KV blocks (the OffloadingConnector's local tier)")
    parser.add_argument("--kv-offloading-backend", choices=["native"],
                        help="what --kv-offloading-size runs on (default native)")
    parser.add_argument("--runner", choices=["auto", "generate", "pooling"],
                        help="generate, or pooling: serve the model as an embedding model (/v1/embeddings, "
                             "docs/embeddings.md); auto: generate (default auto)")
    parser.add_argument("--convert", choices=["auto", "none", "embed"],
                        help="embed: serve a generative checkpoint as an embedding model (the pooling runner) "
                             "(default auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads, split evenly across the --tensor-parallel-size ranks "
                             "(default: torch's choice, one per physical core)")
    add_grammar_limit_args(parser)


def _kv_cache_dtype(value: str) -> str:
    """--kv-cache-dtype's value, normalised; a format pagoda does not store is refused naming what it does."""
    from pagoda.kv_format import kv_cache_dtype_name

    try:
        return kv_cache_dtype_name(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_grammar_limit_args(parser: argparse.ArgumentParser) -> None:
    """One flag per GrammarLimits field (docs/serving-limits.md), its help and default read from the field."""
    from dataclasses import fields

    from pagoda.structured.limits import GrammarLimits, grammar_flag

    for item in fields(GrammarLimits):
        default = getattr(GrammarLimits, item.name)
        parser.add_argument(grammar_flag(item.name), dest=f"grammar_{item.name}", default=None,
                            type=int if isinstance(default, int) else float,
                            help=f"{item.metadata['help']} (default {show_default(default)})")


def engine_flags() -> dict[str, str]:
    """Every flag add_engine_args adds: its destination -> its name on the command line."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return {action.dest: action.option_strings[0] for action in parser._actions}


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from pagoda.entrypoints import ENGINE_OPTIONS, build_engine_config

    given = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    config = build_engine_config(args.model, **given)
    warning = slow_dtype_warning(config)
    if warning:
        logging.getLogger("pagoda").warning(warning)
    return config


def slow_dtype_warning(config: EngineConfig) -> str | None:
    """float16 on a CPU that computes it only through conversions: said at start-up, with the faster choice."""
    from pagoda.kernels import NATIVE_FP16_CPU_FLAGS, cpu_lacks_native_fp16

    if config.dtype != "float16" or config.device != "cpu" or not cpu_lacks_native_fp16():
        return None
    return (f"--dtype float16 on a CPU without native fp16 ({', '.join(sorted(NATIVE_FP16_CPU_FLAGS))}): torch "
            "converts every fp16 matmul here, several times slower than float32; --dtype float32 is faster")


