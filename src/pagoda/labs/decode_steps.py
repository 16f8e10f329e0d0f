"""What the roofline and quantization labs share: calc's figures for one decode step of an engine as built, and
a decode run with each step timed and the engine's own counters read around it."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.calc.deployment import CalcInputs, DecodePoint, decode_point, derive
from pagoda.calc.shapes import GpuSpec, shape_from_path

if TYPE_CHECKING:
    from pagoda import LLM


def calc_step(model: str, gpu: GpuSpec, weight_dtype: str, kv_dtype: str, context: int, batch: int) -> DecodePoint:
    """calc's decode step: `batch` sequences of `context` tokens, weights in `weight_dtype` ("float32", "int8", ...)."""
    inputs = CalcInputs(model=shape_from_path(Path(model)), gpu=gpu, dtype=weight_dtype, kv_dtype=kv_dtype,
                        seq_len=context, batch=batch)
    return decode_point(derive(inputs), batch)


def calc_weight_bytes(model: str, dtype: str) -> float:
    """calc's bytes of weights a batch-1 decode step reads, in `dtype`."""
    return formulas.weight_bytes(shape_from_path(Path(model)).weights_read_params(1), dtype)


def calc_kv_bytes_per_token(model: str, kv_dtype: str) -> float:
    arch = shape_from_path(Path(model)).architecture
    assert arch is not None, f"{model}: the lab needs the model's shape (a config.json)"
    return formulas.kv_bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, kv_dtype)


def calc_weight_dtype(model_dtype: str, quantization: str | None) -> str:
    """The dtype calc counts a weight in: the quantized format where there is one, else the model's."""
    return quantization or model_dtype


@dataclass(frozen=True)
class DecodeRun:
    """The decode steps of one batch, after its prefill: counted by the engine, timed here."""

    batch: int
    steps: int  # engine steps (its tokens-per-step histogram)
    tokens: int  # tokens those steps computed (the same histogram's sum)
    step_seconds: list[float]

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_seconds)


def decode_run(llm: LLM, batch: int, prompt_tokens: int, output_tokens: int, seed: int = 0) -> DecodeRun:
    """`batch` random prompts of `prompt_tokens`, `output_tokens` each (ignore_eos): every prompt prefilled, then
    each decode step timed alone. The budget must take the batch's prompts in one step."""
    from pagoda import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = len(llm.get_tokenizer())
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
    for index in range(batch):
        engine.add_request(f"lab-decode-{seed}-{index}", [rng.randrange(10, vocab) for _ in range(prompt_tokens)],
                           params)
    started: set[str] = set()
    while len(started) < batch:  # the prefill: every request's first token
        started.update(output.request_id for output in engine.step()
                       if isinstance(output.outputs, list) and output.outputs[0].token_ids)
    before = engine.stats()
    seconds = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    after = engine.stats()
    return DecodeRun(batch=batch, steps=sum(after.iteration_token_counts) - sum(before.iteration_token_counts),
                     tokens=after.iteration_tokens_sum - before.iteration_tokens_sum, step_seconds=seconds)
