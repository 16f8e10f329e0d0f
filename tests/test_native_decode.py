"""The native decode stack (kernels/cpu_decode.cpp), on every kernel target the CPU has, against the module path
it replaces.

It runs the same kernels in the same order, so the contract is exact: the same hidden states, KV cache
contents, tokens and logprobs, bit for bit, in every dtype, weight quantization and KV format, with biases (qwen2),
sliding windows (one KV cache group, or full and sliding layers in groups of their own), MQA, per-head q/k norms
(qwen3), post-norms and whole-projection q/k norms (olmo2), sandwich norms scaled by 1 + weight, GeGLU and the
sliding layers' own rope table (gemma3), batching, chunked prefill and preemption around it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import random_prompts

from pagoda import SamplingParams
from pagoda.kernels import TARGET_ENV, available_targets, target_kernels
from pagoda.model.attention import build_metadata
from pagoda.model.native_decode import NativeDecode
from pagoda.model.quantization import KERNEL_MAX_ROWS

pytestmark = pytest.mark.skipif(not available_targets(), reason="this CPU has neither AVX2 + FMA nor AVX-512")


@pytest.fixture(autouse=True, params=available_targets())
def target(request, monkeypatch) -> str:
    """Every test runs on each target the CPU has: the models it builds load that target's kernels."""
    monkeypatch.setenv(TARGET_ENV, request.param)
    return request.param

CONFIGS = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "int8": {"dtype": "bfloat16", "quantization": "int8"},
           "int4": {"quantization": "int4"}, "int4-bf16": {"dtype": "bfloat16", "quantization": "int4"},
           "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8-bf16": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}}
KV_FIELDS = ("k", "v", "k_scale", "v_scale")


def _random_like(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random contents for one of a LayerKV's tensors: positive scales, int8 codes over their range."""
    if tensor.dim() < 3:
        return torch.rand(tensor.shape, generator=gen) * 0.1 + 0.01
    return (torch.randn(tensor.shape, generator=gen) * (40 if tensor.dtype == torch.int8 else 1)).to(tensor.dtype)


def _with_tensors(kv, make):
    return replace(kv, **{name: make(getattr(kv, name)) for name in KV_FIELDS if getattr(kv, name) is not None})


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


class CountingStack:
    """Wraps a NativeDecode's stack, counting the steps it ran (`calls`), those with adapter rows apart."""

    def __init__(self, stack) -> None:
        self.stack, self.calls, self.lora_calls = stack, 0, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)

    def forward_lora(self, *args):
        self.lora_calls += 1
        return self.stack.forward_lora(*args)

    def add_lora_part(self, *args):
        self.stack.add_lora_part(*args)


def _generate(llm, prompts, native: bool):
    backend = llm.engine.model.backend
    counter = None
    if native:
        counter = backend.decode_runner.stack = CountingStack(backend.decode_runner.stack)
    else:
        backend.decode_runner = None
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], counter


# qwen2-swa with every layer sliding: one KV cache group, whose tables hold -1 for the blocks its window dropped;
# as the test checkpoint has it ("qwen2-swa-mixed"), full and sliding layers in a group each.
SLIDING_EVERY_LAYER = {"max_window_layers": 0}


def _checkpoint(checkpoint, arch: str):
    if arch == "qwen2-swa-mixed":
        return checkpoint("qwen2-swa")
    return checkpoint(arch, **SLIDING_EVERY_LAYER) if arch == "qwen2-swa" else checkpoint(arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2-swa", "qwen2-swa-mixed", "llama-mqa", "qwen3", "olmo2", "gemma2",
                                  "gemma3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_output_is_bit_identical_to_module_path(make_llm, checkpoint, arch, config, target):
    """Greedy tokens and their logprobs, exactly equal, with chunking and preemption in the mix."""
    model_dir = _checkpoint(checkpoint, arch)
    prompts = random_prompts([3, 30, 47, 12, 9], seed=11)
    # A sliding group holds its window only: a smaller pool keeps preemption in the mix. (Gemma's groups share
    # the pool otherwise: they take more blocks to hold their longest sequence.)
    blocks = {"qwen2-swa": 14, "gemma2": 48, "gemma3": 48}.get(arch, 28)
    options = {"max_num_batched_tokens": 9, "num_kv_blocks": blocks, **CONFIGS[config]}
    native_llm, module_llm = make_llm(model_dir, **options), make_llm(model_dir, **options)
    assert native_llm.engine.model.backend.kernels.target == target
    assert native_llm.engine.model.backend.decode_runner is not None
    native, counter = _generate(native_llm, prompts, native=True)
    module, _ = _generate(module_llm, prompts, native=False)
    assert native == module
    assert counter.calls > 10, "the stack must have run the decode steps"
    assert native_llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe", "qwen2-moe"])
@pytest.mark.parametrize("config", ["fp32", "bf16", "int8", "int4-bf16"])
def test_sparse_layers_decode_in_the_stack_as_in_the_modules(make_llm, checkpoint, arch, config):
    """A mixture of experts (Qwen3-MoE's dense layer beside sparse ones, Qwen2-MoE's shared expert) decodes through
    the stack with the modules' tokens and logprobs, bit for bit, and routes the same load per expert."""
    model_dir = checkpoint(arch)
    options = {"max_num_batched_tokens": 9, "num_kv_blocks": 28, **CONFIGS[config]}
    native_llm, module_llm = make_llm(model_dir, **options), make_llm(model_dir, **options)
    prompts = random_prompts([3, 30, 47, 12, 9], seed=11)
    native, counter = _generate(native_llm, prompts, native=True)
    module, _ = _generate(module_llm, prompts, native=False)
    assert native == module
    assert counter.calls > 10, "the stack must have run the decode steps"
    assert native_llm.engine.stats().experts == module_llm.engine.stats().experts


def _scattered_tables(seq_lens: list[int], gen: torch.Generator) -> list[list[int]]:
    order, tables = torch.randperm(64, generator=gen).tolist(), []
    for n in seq_lens:
        tables.append(order[: -(-n // 4)])
        order = order[len(tables[-1]) :]
    return tables


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("arch", "batch"), [("qwen2-swa", 4), ("qwen3", 1), ("qwen3", 4), ("olmo2", 4),
                                             ("gemma2", 4), ("gemma3", 1), ("gemma3", 4), ("qwen2-moe", 4)])
def test_step_hidden_states_and_cache_are_bit_identical(make_llm, checkpoint, config, arch, batch):
    """One decode step at scattered blocks, from the same cache: equal outputs and caches. (qwen3's head
    norms take the fused kernel for one token and torch's ops for more, in both paths.) Where full and sliding
    layers mix, they read through KV cache groups of their own, with different tables."""
    llm = make_llm(checkpoint(arch), num_kv_blocks=64, **CONFIGS[config])
    model = llm.engine.model
    gen = torch.Generator().manual_seed(5)
    caches = [_with_tensors(kv, lambda t: _random_like(t, gen)) for kv in llm.engine.runner.kv_caches]
    seq_lens = [1, 6, 17, 33, 60][-batch:]
    windows = model.config.sliding_windows
    meta = build_metadata([1] * batch, seq_lens, _scattered_tables(seq_lens, gen), 4, set(windows) or {None})
    if arch in ("qwen2-swa", "gemma2", "gemma3"):  # their test checkpoints mix full and sliding layers
        assert None in windows and len(set(windows)) == 2
        sliding = build_metadata([1] * batch, seq_lens, _scattered_tables(seq_lens, gen), 4, set(windows))
        meta.group_metas, meta.layer_groups = [meta, sliding], [0 if window is None else 1 for window in windows]
    input_ids = torch.randint(0, model.config.vocab_size, (batch,), generator=gen)

    def step(native: NativeDecode | None):
        model.backend.decode_runner = native
        step_caches = [_with_tensors(kv, torch.Tensor.clone) for kv in caches]
        with torch.inference_mode():
            return model(input_ids, meta.positions, step_caches, meta), step_caches

    native = model.backend.decode_runner
    assert native is not None and native.takes(meta, batch)
    native_hidden, native_caches = step(native)
    module_hidden, module_caches = step(None)
    assert torch.equal(native_hidden, module_hidden)
    for native_kv, module_kv in zip(native_caches, module_caches):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(native_kv.tensors(), module_kv.tensors()))


def test_stack_takes_only_decode_steps_its_gemvs_cover(make_llm, checkpoint, target):
    model = make_llm(checkpoint("llama"), dtype="bfloat16").engine.model
    native = model.backend.decode_runner
    decode = build_metadata([1] * 3, [4, 8, 9], [[0, 1], [2, 3], [4, 5, 6]], 4, {None})
    mixed = build_metadata([1, 5], [4, 5], [[0], [1, 2]], 4, {None})
    assert native.takes(decode, 3) and not native.takes(mixed, 6)
    bound = target_kernels(target).gemv_max_rows
    assert native.takes(decode, bound) and not native.takes(decode, bound + 1)  # then GEMMs


def test_stack_takes_as_many_tokens_as_the_fp32_gemvs_do(make_llm, checkpoint, target):
    """The GEMVs take as many rows as their target's module says (AVX-512: 64; AVX2, whose blocking keeps up with
    torch's GEMM held to AVX2 further: 512), and so does the stack."""
    model = make_llm(checkpoint("llama")).engine.model
    bound = target_kernels(target).gemv_max_rows
    assert bound == (512 if target in ("avx2", "neon") else KERNEL_MAX_ROWS)
    assert model.layers[0].mlp.down_proj.max_rows == bound
    decode = build_metadata([1] * 3, [4, 8, 9], [[0, 1], [2, 3], [4, 5, 6]], 4, {None})
    native = model.backend.decode_runner
    assert native.takes(decode, bound) and not native.takes(decode, bound + 1)


def test_stack_is_off_where_it_does_not_cover_the_model(make_llm, checkpoint):
    narrow = checkpoint("llama", hidden_size=48, num_heads=3, num_kv_heads=1)  # K = 48: not a GEMV width
    assert make_llm(narrow).engine.model.backend.decode_runner is None
    assert make_llm(checkpoint("llama"), use_kernels=False).engine.model.backend.decode_runner is None
