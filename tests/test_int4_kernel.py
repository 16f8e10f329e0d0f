"""pagoda's int4 kernel (kernels/cpu_int4.cpp) against its torch reference, and the layer and engine that run it.

Bounds: the kernel computes W times x quantized per group to int8 (`reference_matmul_int4`), so against that
reference it differs only in fp32 summation order (relative 1e-5 of the output's scale); against the exact
x @ W.T each output is off by at most sum_k |W[n, k]| * x_scale(k) / 2, half a code step of x per column.
"""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels
from pagoda.model.int4 import Int4Linear, Int4Options, quantize_int4
from pagoda.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.reference_kernels import ReferenceKernels, reference_matmul_int4


def _int4_module():
    return pagoda.kernels.cpu_kernels() or pagoda.kernels.avx2_kernels()


pytestmark = pytest.mark.skipif(_int4_module() is None, reason="this CPU lacks AVX2/FMA: no int4 kernel")


def _layer(out_features: int, in_features: int, group_size: int, sym: bool = False) -> Int4Linear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features)) * 0.05
    return Int4Linear(quantize_int4(weight, Int4Options(group_size=group_size, sym=sym)), None, _int4_module())


def _padded_input(layer: Int4Linear, rows: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, layer.padded_in, generator=torch.Generator().manual_seed(seed))
    x[:, layer.in_features :] = 0  # the layer's padding
    return x


@pytest.mark.parametrize(("out_features", "in_features", "group_size", "sym"), [
    (32, 32, 32, False), (40, 72, 32, False), (96, 128, 64, True), (64, 384, 128, False), (320, 704, 64, False),
])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, 33, 64, 130])
def test_kernel_matches_its_reference_and_the_stated_bound(out_features, in_features, group_size, sym, rows):
    layer = _layer(out_features, in_features, group_size, sym)
    x = _padded_input(layer, rows, seed=rows)
    args = (layer.packed, layer.kernel_group, layer.scales_and_zeros)
    y = _int4_module().matmul_int4(x, *args)
    assert y.shape == (rows, layer.padded_out) and y.dtype == torch.float32
    reference = reference_matmul_int4(x, *args)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))

    weight = layer.dequantize()
    x_step = (x.view(rows, -1, layer.kernel_group).abs().amax(-1, keepdim=True) / 127).expand(
        -1, -1, layer.kernel_group).reshape(rows, -1)
    bound = (x_step / 2) @ weight.abs().T
    error = (y - x @ weight.T).abs()
    assert bool((error <= bound * (1 + 1e-4) + 1e-5).all()), float((error - bound).max())


def test_bf16_input_gives_bf16_output_and_zero_rows_give_zeros():
    layer = _layer(64, 128, 32)
    x = _padded_input(layer, 3, seed=1)
    x[1] = 0  # a group of zeros has scale 0: its codes are 0, not NaN
    y = _int4_module().matmul_int4(x.bfloat16(), layer.packed, layer.kernel_group, layer.scales_and_zeros)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    expected = reference_matmul_int4(x.bfloat16().float(), layer.packed, layer.kernel_group, layer.scales_and_zeros)
    torch.testing.assert_close(y.float(), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max()))


def test_bad_shapes_are_refused():
    layer = _layer(64, 128, 32)
    args = (layer.packed, layer.kernel_group, layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="M >= 1"):
        _int4_module().matmul_int4(torch.randn(0, 128), *args)
    with pytest.raises(RuntimeError, match="disagree on K"):
        _int4_module().matmul_int4(torch.randn(1, 96), *args)
    with pytest.raises(RuntimeError, match="group"):
        _int4_module().matmul_int4(torch.randn(1, 128), layer.packed, 48, layer.scales_and_zeros)


def test_layer_takes_the_kernel_for_every_row_count():
    """With the kernel every input runs it (decode and prefill alike), padding and bias handled by the layer."""
    layer = _layer(96, 200, 64)  # 200 columns: padded to 256 by the layer, a ragged last group
    layer.bias = torch.nn.Parameter(torch.randn(96), requires_grad=False)
    for rows in (1, 8, 64, 65, 200):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
        padded = torch.nn.functional.pad(x, (0, layer.padded_in - 200))
        expected = reference_matmul_int4(padded, layer.packed, layer.kernel_group, layer.scales_and_zeros)[:, :96]
        torch.testing.assert_close(layer(x), expected + layer.bias, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_engine_runs_int4_layers_through_the_kernel(make_llm, checkpoint, monkeypatch):
    """Where the kernel loads, an int4 model's layers hold it; greedy output equals the same model's with the
    kernel's torch reference in its place (the loader's seam, exercised on any CPU)."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([6, 21, 3], seed=12)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = make_llm(model_dir, quantization="int4")
    assert llm.engine.model.layers[0].mlp.down_proj.kernels is not None
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    reference = ReferenceKernels()
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", lambda: None)
    monkeypatch.setattr(pagoda.kernels, "avx2_kernels", lambda: reference)
    assert [o.outputs[0].token_ids for o in make_llm(model_dir, quantization="int4").generate(prompts, params)] \
        == expected
    assert reference.called("matmul_int4") > 0


def test_the_startup_summary_names_what_int4_layers_run(make_llm, checkpoint):
    from pagoda.startup import startup_summary

    def quantization_row(llm) -> str:
        return next(line for line in startup_summary(llm.engine, "m").splitlines() if "quantization" in line)

    with_kernel = make_llm(checkpoint("llama"), quantization="int4")
    assert quantization_row(with_kernel).endswith("; pagoda's int4 kernel, x as int8 per group")
    without = make_llm(checkpoint("llama"), quantization="int4", use_kernels=False)
    assert without.engine.model.layers[0].mlp.down_proj.kernels is None
    assert quantization_row(without).endswith("; torch's int4 matmul up to 64 rows, dequantized tiles beyond")
