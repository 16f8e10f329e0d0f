"""The offline API: `pagoda.LLM(model_dir, **engine_options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeGuard, cast

from pagoda.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    dtype_name,
    int4_options_from,
    speculative_config_from,
)
from pagoda.engine.api import RequestOutput
from pagoda.engine.engine import LLMEngine
from pagoda.sampling import SamplingParams
from pagoda.structured.limits import GRAMMAR_OPTIONS, GrammarLimits
from pagoda.text.tokenizer import Tokenizer

Prompt = str | list[int]


# The engine options, by vLLM's names, grouped by the part of EngineConfig they set.
TOP_LEVEL_OPTIONS = ("dtype", "device", "seed", "quantization", "quantization_config", "use_kernels",
                     "speculative_config")
CACHE_OPTIONS = ("block_size", "kv_cache_memory_bytes", "num_kv_blocks", "enable_prefix_caching", "kv_cache_dtype",
                 "calculate_kv_scales")
SCHEDULER_OPTIONS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_step_ms",
                     "long_prefill_token_threshold", "scheduling_policy", "priority_aging_s")
PARALLEL_OPTIONS = ("tensor_parallel_size", "distributed_executor_backend")
ENGINE_OPTIONS = TOP_LEVEL_OPTIONS + CACHE_OPTIONS + SCHEDULER_OPTIONS + GRAMMAR_OPTIONS + PARALLEL_OPTIONS
# Options whose config field has another name (grammar_X sets GrammarLimits.X).
FIELD_NAMES = {"num_kv_blocks": "num_blocks", "kv_cache_dtype": "cache_dtype",
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
    return EngineConfig(
        model=str(model),
        **_given(options, TOP_LEVEL_OPTIONS),
        cache=CacheConfig(**_given(options, CACHE_OPTIONS)),
        scheduler=SchedulerConfig(**_given(options, SCHEDULER_OPTIONS)),
        grammar=GrammarLimits(**_given(options, GRAMMAR_OPTIONS)),
        parallel=ParallelConfig(**_given(options, PARALLEL_OPTIONS)),
    )


def _given(options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The options among `names` that were given, keyed by the config field each one sets."""
    return {FIELD_NAMES.get(name, name): options[name] for name in names if name in options}


def _is_token_ids(prompts: object) -> TypeGuard[list[int]]:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


class LLM:
    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options))
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

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
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or a list of token ids. `priority`
        (vLLM's): one per prompt, lower first; only with scheduling_policy="priority"."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = cast(Sequence[Prompt], prompts)  # not one prompt, so a sequence of them
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams, or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError("need one priority per prompt")
        ids = []
        try:
            for prompt, p, level in zip(prompts, params_list, priorities):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p, priority=level)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a rejected prompt leaves no orphans behind
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else sys.stderr.isatty())

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
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
        return [finished[i] for i in ids]
