"""Which implementation a model runs (model/backends.py) and how the kernels are wired into it, on any CPU:
the compiled kernels are replaced by torch stand-ins (reference_kernels.py) that log every call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_prompts
from reference_kernels import ReferenceKernels

import pagoda.kernels
from pagoda import SamplingParams
from pagoda.model.attention import CpuAttentionBackend, TorchAttentionBackend, build_metadata
from pagoda.model.backends import create_runtime
from pagoda.model.kv_cache import LayerKV
from pagoda.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagoda.model.llama import LlamaModel
from pagoda.model.loader import load_model, load_model_config
from pagoda.model.native_decode import NativeDecode
from pagoda.model.quantization import DenseLinear, Int8Linear


@pytest.fixture
def stand_in(monkeypatch) -> ReferenceKernels:
    """The loader gets the torch stand-ins in place of the compiled kernels."""
    kernels = ReferenceKernels()
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", lambda: kernels)
    return kernels


@pytest.mark.parametrize(("dtype", "changes", "attention", "fused", "decode_stack"), [
    (torch.float32, {}, CpuAttentionBackend, True, True),
    (torch.bfloat16, {}, CpuAttentionBackend, True, True),
    (torch.float16, {}, TorchAttentionBackend, False, False),  # GEMVs only (int8)
    (torch.float32, {"hidden_size": 48}, CpuAttentionBackend, True, False),  # K = 48: no GEMV
    (torch.float32, {"intermediate_size": 80}, CpuAttentionBackend, True, False),  # down_proj's K = 80
    (torch.float32, {"head_dim": 160}, TorchAttentionBackend, True, False),
    (torch.float32, {"head_dim": 24}, TorchAttentionBackend, True, False),
    (torch.float32, {"num_heads": 34, "num_kv_heads": 2}, TorchAttentionBackend, True, False),  # 17 per kv head
])
def test_runtime_choice(checkpoint, dtype, changes, attention, fused, decode_stack):
    config = dataclasses.replace(load_model_config(checkpoint("llama")), **changes)
    kernels = ReferenceKernels()
    runtime = create_runtime(config, dtype, kernels)
    assert type(runtime.attention) is attention
    assert runtime.kernels is (kernels if fused else None)
    assert runtime.gemv_kernels is kernels
    if attention is CpuAttentionBackend:
        assert runtime.attention.kernels is kernels and runtime.attention.decode_stack == decode_stack
    reference = create_runtime(config, dtype, None)
    assert type(reference.attention) is TorchAttentionBackend and reference.kernels is reference.gemv_kernels is None
    assert runtime.quantized_kernels is None and reference.quantized_kernels is None


@pytest.mark.parametrize("full_set", [True, False])
def test_integer_matmuls_go_to_quantized_models(checkpoint, full_set):
    """int4 models get the integer matmuls' module (the full set, or the AVX2 one alone); int8 models only
    without the full set, whose int8 GEMV the native decode stack shares; unquantized models never."""
    config = load_model_config(checkpoint("llama"))
    kernels, integer = (ReferenceKernels(),) * 2 if full_set else (None, ReferenceKernels())
    runtime = create_runtime(config, torch.float32, kernels, "int4", integer)
    assert runtime.quantized_kernels is integer and runtime.gemv_kernels is kernels
    assert runtime.attention.decode_stack if full_set else type(runtime.attention) is TorchAttentionBackend
    int8 = create_runtime(config, torch.float32, kernels, "int8", integer)
    assert int8.quantized_kernels is (None if full_set else integer)
    assert create_runtime(config, torch.float32, kernels, None, integer).quantized_kernels is None


def test_model_defaults_to_the_torch_reference_and_has_its_rotary_tables(checkpoint):
    config = load_model_config(checkpoint("llama3"))
    model = LlamaModel(config)
    assert type(model.backend) is TorchAttentionBackend and model.backend.decode_runner is None
    assert all(m.kernels is None for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP)))
    expected = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    assert torch.equal(model.rotary.cos, expected.cos) and torch.equal(model.rotary.sin, expected.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_survive_the_meta_build_in_fp32(checkpoint, dtype):
    model, config = load_model(checkpoint("llama3"), dtype=dtype, use_kernels=False)
    expected = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    assert model.rotary.cos.dtype == torch.float32 and model.rotary.cos.device.type == "cpu"
    assert torch.equal(model.rotary.cos, expected.cos) and torch.equal(model.rotary.sin, expected.sin)


@pytest.mark.parametrize(("dtype", "quantization"), [(torch.float32, None), (torch.bfloat16, "int8")])
def test_kernels_reach_every_module_at_construction(checkpoint, stand_in, dtype, quantization):
    model, config = load_model(checkpoint("qwen3"), dtype=dtype, quantization=quantization)
    assert type(model.backend) is CpuAttentionBackend and model.backend.kernels is stand_in
    norms_and_mlps = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP))]
    assert len(norms_and_mlps) == 5 * config.num_layers + 1  # 2 norms, 2 head norms, 1 MLP a layer; final norm
    assert all(m.kernels is stand_in for m in norms_and_mlps)
    linear_type = Int8Linear if quantization else DenseLinear
    linears = [m for m in model.modules() if isinstance(m, linear_type)]
    assert len(linears) == 4 * config.num_layers + 1  # LM head included
    assert all((m.kernels if quantization else m.gemv.__self__) is stand_in for m in linears)


def test_decode_stack_is_built_from_the_loaded_weights_in_layer_order(checkpoint, stand_in):
    model, config = load_model(checkpoint("qwen2-swa"), dtype=torch.bfloat16, quantization="int8")
    assert isinstance(model.backend.decode_runner, NativeDecode)
    (name, (heads, kv_heads, head_dim, eps, scale, softcap, final_norm, placement, unit_offset, gelu)), *layers = \
        stand_in.log
    assert name == "DecodeStack" and (heads, kv_heads, head_dim) == (config.num_heads, config.num_kv_heads,
                                                                      config.head_dim)
    assert eps == config.rms_norm_eps and scale == config.head_dim**-0.5 and final_norm is model.norm.weight
    assert softcap == 0.0
    assert (placement, unit_offset, gelu) == ("pre", False, False)
    assert len(layers) == config.num_layers
    for layer, (name, args) in zip(model.layers, layers):
        attention, mlp = layer.self_attn, layer.mlp
        assert name == "DecodeStack.add_layer"
        input_norm, post_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm, *specs, window, sliding_rope = args
        assert input_norm is layer.input_layernorm.weight and post_norm is layer.post_attention_layernorm.weight
        assert pre_ff_norm is None and post_ff_norm is None and not sliding_rope
        assert q_norm is None and k_norm is None  # qwen2: no per-head norms
        for spec, linear in zip(specs, (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            assert spec[0] is linear.qweight and spec[1] is linear.scale and spec[2] is linear.bias
        assert window == (attention.window or 0)
    assert {args[-2] for _, args in layers} == {0, 24}  # the test checkpoint mixes full and sliding layers


def test_no_decode_stack_where_a_linear_is_no_gemv(checkpoint, stand_in):
    model, _ = load_model(checkpoint("llama", hidden_size=48, num_heads=3, num_kv_heads=1))
    assert type(model.backend) is CpuAttentionBackend and model.backend.decode_runner is None
    assert stand_in.called("DecodeStack") == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2-swa", "olmo2", "gemma2", "gemma3"])
def test_decode_stack_step_is_bit_identical_to_the_module_path(checkpoint, stand_in, arch):
    """With the stand-ins, the module path and the stack (which follows cpu_decode.cpp) call the same ops
    in the same order: equal hidden states and caches, as the compiled stack promises."""
    model, config = load_model(checkpoint(arch), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    shape = (64 * 4, config.num_kv_heads, config.head_dim)
    caches = [LayerKV(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
              for _ in range(config.num_layers)]
    meta = build_metadata([1] * 3, [5, 17, 40], [[1, 9], [2, 3, 4, 5, 6], list(range(10, 20))], 4,
                          set(config.sliding_windows) or {None})
    input_ids = torch.randint(0, config.vocab_size, (3,), generator=gen)
    runner = model.backend.decode_runner
    assert runner is not None and runner.takes(meta, 3)

    def step() -> tuple[torch.Tensor, list[LayerKV]]:
        step_caches = [LayerKV(kv.k.clone(), kv.v.clone()) for kv in caches]
        with torch.inference_mode():
            return model(input_ids, meta.positions, step_caches, meta), step_caches

    stack_hidden, stack_caches = step()
    assert stand_in.called("DecodeStack.forward") == 1 and stand_in.called("paged_decode_attention") == 0
    model.backend.decode_runner = None
    module_hidden, module_caches = step()
    assert stand_in.called("paged_decode_attention") == config.num_layers
    assert torch.equal(stack_hidden, module_hidden)
    assert all(torch.equal(a, b) for kv, other in zip(stack_caches, module_caches)
               for a, b in zip(kv.tensors(), other.tensors()))


def test_engine_runs_the_kernel_wiring_to_the_torch_paths_tokens(make_llm, checkpoint, stand_in):
    """fp32 greedy decode with chunked prefills, the stand-ins in every kernel seat: the torch path's tokens."""
    model_dir = checkpoint("qwen3")  # head_dim 32: prefills through the prefill kernel's seat too
    prompts = random_prompts([3, 30, 47, 12], seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = {"max_num_batched_tokens": 9, "num_kv_blocks": 40}
    wired = make_llm(model_dir, **options)
    reference = make_llm(model_dir, use_kernels=False, **options)
    assert type(wired.engine.model.backend) is CpuAttentionBackend
    wired_ids = [o.outputs[0].token_ids for o in wired.generate(prompts, params, use_tqdm=False)]
    reference_ids = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert wired_ids == reference_ids
    for op in ("DecodeStack.forward", "paged_prefill_attention_", "paged_decode_attention", "rotary_write_kv_",
               "add_rms_norm_", "silu_mul", "gemv_fp32"):
        assert stand_in.called(op), f"{op} never ran"
