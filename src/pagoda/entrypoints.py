"""The offline API: `pagoda.LLM(model_dir, **engine_options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig, parse_dtype
from pagoda.engine.engine import LLMEngine
from pagoda.engine.output import RequestOutput
from pagoda.sampling import SamplingParams

Prompt = str | list[int]


def build_engine_config(
    model: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    quantization: str | None = None,
    use_kernels: bool = True,
    max_model_len: int = 2048,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    block_size: int = 16,
    kv_cache_memory_bytes: int = 2 << 30,
    num_kv_blocks: int | None = None,
    enable_prefix_caching: bool = True,
) -> EngineConfig:
    """Engine options with vLLM's names -> EngineConfig. Shared by LLM and the CLI."""
    if max_num_batched_tokens < 1 or max_num_seqs < 1 or block_size < 1:
        raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be positive")
    return EngineConfig(
        model=str(model),
        dtype=parse_dtype(dtype),
        device=device,
        seed=seed,
        quantization=quantization,
        use_kernels=use_kernels,
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            num_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
    )


class LLM:
    def __init__(self, model: str, **engine_options) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options))
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams, or one per prompt")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a rejected prompt leaves no orphans behind
            raise
        return self._run(ids, use_tqdm if use_tqdm is not None else sys.stderr.isatty())

    def _run(self, ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="requests", unit="req")
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[i] for i in ids]
