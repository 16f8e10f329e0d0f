"""The offline API: `pagoda.LLM(model_dir, **engine_options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard, TypeVar, cast

from pagoda.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    dtype_name,
    speculative_config_from,
)
from pagoda.engine.api import EmbeddingRequestOutput, EngineOutput, RequestOutput
from pagoda.engine.engine import LLMEngine
from pagoda.int4_format import int4_options_from
from pagoda.kv_transfer_config import KVTransferConfig, kv_transfer_config_from, offloading_shorthand
from pagoda.lora_request import LoRARequest
from pagoda.pooling import PoolingParams, resolve_runner
from pagoda.sampling import SamplingParams
from pagoda.structured.limits import GRAMMAR_OPTIONS, GrammarLimits
from pagoda.text.tokenizer import Tokenizer

Prompt = str | list[int]
# What generate() and embed() take for one prompt: a Prompt, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.
PromptInput = Prompt | dict[str, Any]
_Output = TypeVar("_Output", RequestOutput, EmbeddingRequestOutput)


# The engine options, by vLLM's names, grouped by the part of EngineConfig they set.
TOP_LEVEL_OPTIONS = ("dtype", "device", "seed", "quantization", "quantization_config", "use_kernels",
                     "speculative_config")
CACHE_OPTIONS = ("block_size", "kv_cache_memory_bytes", "num_kv_blocks", "enable_prefix_caching", "kv_cache_dtype",
                 "calculate_kv_scales")
SCHEDULER_OPTIONS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_step_ms",
                     "long_prefill_token_threshold", "scheduling_policy", "priority_aging_s", "batching")
PARALLEL_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
                    "enable_expert_parallel", "enable_eplb", "cpu_threads_bind", "cpu_threads_adapt")
LORA_OPTIONS = ("max_loras", "max_cpu_loras", "max_lora_rank")  # with enable_lora=True only
# vLLM's connector option and its offloading shorthand, which together make EngineConfig.kv_transfer_config.
KV_TRANSFER_OPTIONS = ("kv_transfer_config", "kv_offloading_size", "kv_offloading_backend")
RUNNER_OPTIONS = ("runner", "convert")  # vLLM's: resolved into EngineConfig.runner (pooling.resolve_runner)
ENGINE_OPTIONS = (TOP_LEVEL_OPTIONS + CACHE_OPTIONS + SCHEDULER_OPTIONS + GRAMMAR_OPTIONS + PARALLEL_OPTIONS
                  + ("enable_lora",) + LORA_OPTIONS + KV_TRANSFER_OPTIONS + RUNNER_OPTIONS)
# Options whose config field has another name (grammar_X sets GrammarLimits.X).
FIELD_NAMES = {"num_kv_blocks": "num_blocks", "enable_lora": "lora", "convert": "runner",
               "kv_cache_dtype": "cache_dtype",
               **{option: option.removeprefix("grammar_") for option in GRAMMAR_OPTIONS}}


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """Engine options with vLLM's names -> EngineConfig. Shared by LLM and the CLI.

    An option not given keeps the default that pagoda.config writes for it.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
    if "dtype" in options:
        options["dtype"] = dtype_name(options["dtype"])
    if "speculative_config" in options:  # vLLM's JSON object (a dict), or a SpeculativeConfig
        options["speculative_config"] = speculative_config_from(options["speculative_config"])
    if "quantization_config" in options:  # a JSON object of int4 options, or Int4Options
        options["quantization_config"] = int4_options_from(options["quantization_config"])
    lora = None
    if options.get("enable_lora"):
        lora = LoRAConfig(**_given(options, LORA_OPTIONS))
    elif given_lora := [name for name in LORA_OPTIONS if name in options]:
        raise ValueError(f"{', '.join(given_lora)} apply to LoRA adapters only: give enable_lora=True (--enable-lora)")
    runner = resolve_runner(options.get("runner", "auto"), options.get("convert", "auto"))
    return EngineConfig(
        model=str(model),
        runner=runner,
        **_given(options, TOP_LEVEL_OPTIONS),
        cache=CacheConfig(**_given(options, CACHE_OPTIONS)),
        scheduler=SchedulerConfig(**_given(options, SCHEDULER_OPTIONS)),
        grammar=GrammarLimits(**_given(options, GRAMMAR_OPTIONS)),
        parallel=ParallelConfig(**_given(options, PARALLEL_OPTIONS)),
        lora=lora,
        kv_transfer_config=_kv_transfer(options),
    )


def _kv_transfer(options: dict[str, Any]) -> KVTransferConfig | None:
    """kv_transfer_config (vLLM's JSON object), or the shorthand kv_offloading_size GiB (+ kv_offloading_backend)."""
    size, backend = options.get("kv_offloading_size"), options.get("kv_offloading_backend")
    if size is None:
        if backend is not None:
            raise ValueError("kv_offloading_backend needs kv_offloading_size")
        return kv_transfer_config_from(options.get("kv_transfer_config"))
    if options.get("kv_transfer_config") is not None:
        raise ValueError("give kv_transfer_config or kv_offloading_size, not both")
    return offloading_shorthand(size, backend)


def _given(options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The options among `names` that were given, keyed by the config field each one sets."""
    return {FIELD_NAMES.get(name, name): options[name] for name in names if name in options}


def _is_token_ids(prompts: object) -> TypeGuard[list[int]]:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def _as_prompt(prompt: object) -> Prompt:
    """One prompt as the engine takes it: a string, token ids, or vLLM's dict forms ({"prompt": text} or
    {"prompt_token_ids": ids}); anything else is refused, never read as something it is not."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and _is_token_ids(prompt["prompt_token_ids"]):
            return prompt["prompt_token_ids"]
        raise ValueError(f"a prompt dict takes one key, 'prompt' (a string) or 'prompt_token_ids' (a list of "
                         f"token ids); got keys {sorted(keys)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return prompt  # an empty one too: the engine refuses it, naming the prompt
    raise ValueError(f"a prompt is a string, a list of token ids or a dict of either; got {type(prompt).__name__}")


def _prompt_list(prompts: object) -> list[Prompt]:
    """`prompts` as a list: one prompt (in any accepted form) or a list or tuple of them."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [_as_prompt(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return [_as_prompt(p) for p in prompts]


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options))
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def start_profile(self) -> None:
        """Begins recording the engine's steps as a timeline (vLLM's name; pagoda records its own steps, not a
        torch profile)."""
        self.engine.trace.start()

    def stop_profile(self, path: str | Path | None = None) -> dict[str, Any]:
        """The timeline since start_profile as a Chrome Trace Event Format document (written to `path` when
        given: open it in Perfetto or chrome://tracing); recording ends."""
        document = self.engine.trace.stop()
        if path is not None:
            Path(path).write_text(json.dumps(document), encoding="utf-8")
        return document

    def close(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); idempotent. Also on `with LLM(...)`'s exit,
        and at the latest when the LLM is collected or the interpreter exits."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids, or vLLM's dict of
        either (`{"prompt": text}`, `{"prompt_token_ids": ids}`). `priority`
        (vLLM's): one per prompt, lower first; only with scheduling_policy="priority". `lora_request` (vLLM's):
        the LoRA adapter of every prompt, or one per prompt (None: the base model); only with enable_lora=True."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams, or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError("need one priority per prompt")
        adapters = (list(lora_request) if isinstance(lora_request, Sequence)
                    else [lora_request] * len(prompts))
        if len(adapters) != len(prompts):
            raise ValueError("need one LoRARequest, or one per prompt")
        ids = []
        try:
            for prompt, p, level, adapter in zip(prompts, params_list, priorities, adapters):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p, priority=level, lora_request=adapter)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a rejected prompt leaves no orphans behind
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else sys.stderr.isatty(), RequestOutput)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One EmbeddingRequestOutput per prompt, in order (vLLM's): `.outputs.embedding`, a list of floats.
        Needs the pooling runner (LLM(model, runner="pooling")); the model's files say how it pools
        (pagoda/pooling.py). pooling_params: one for all prompts, or one per prompt."""
        prompts = _prompt_list(prompts)
        params = pooling_params or PoolingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one PoolingParams, or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else sys.stderr.isatty(), EmbeddingRequestOutput)

    def _run(self, ids: list[str], show_progress: bool, kind: type[_Output]) -> list[_Output]:
        finished: dict[str, EngineOutput] = {}
        progress = None
        if show_progress:
            from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs)

            progress = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                failures = self.engine.pop_failures()
                if failures:  # the failed request is already aborted: stop the rest too, and say why
                    request_id, error = next(iter(failures.items()))
                    raise RuntimeError(f"request {request_id} failed: {error}") from error
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        outputs = [finished[i] for i in ids]
        assert all(isinstance(output, kind) for output in outputs)
        return cast(list[_Output], outputs)
