"""pagoda's integer matmuls for quantized weights (kernels/cpu_int4.cpp, cpu_int8.cpp; AVX2) against their torch
references, and the layers and engine that run them.

Bounds: each kernel computes W times x quantized per group to int8 (`reference_matmul_int4/8`), so against
that reference it differs only in fp32 summation order (relative 1e-5 of the output's scale); against the
exact x @ W.T each output is off by at most sum_k |W[n, k]| * x_step(k) / 2, half a code step of x per column.
"""

from __future__ import annotations

import sys

import pytest
import torch

import pagoda.kernels
from pagoda.int4_format import Int4Options
from pagoda.model.int4 import Int4Linear, quantize_int4
from pagoda.model.quantization import INT8_MATMUL_MAX_ROWS, Int8Linear
from pagoda.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.reference_kernels import (
    ReferenceKernels,
    int8_codes_dequantized,
    reference_matmul_int4,
    reference_matmul_int8,
)


# Each kernel target the CPU runs: the full set (avx512) and the AVX2 module.
@pytest.fixture(params=pagoda.kernels.available_targets())
def module(request):
    built = pagoda.kernels.target_kernels(request.param)
    assert built is not None, f"the CPU runs the {request.param} target, so its kernels must build"
    return built

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64, 130]


def _assert_within_x_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: int) -> None:
    """|y - x W^T| <= |W| times half of x's code step, column by column."""
    rows = x.shape[0]
    x_step = (x.view(rows, -1, group).abs().amax(-1, keepdim=True) / 127).expand(-1, -1, group).reshape(rows, -1)
    bound = (x_step / 2) @ weight.abs().T
    error = (y - x @ weight.T).abs()
    assert bool((error <= bound * (1 + 1e-4) + 1e-5).all()), float((error - bound).max())


def _layer(module, out_features: int, in_features: int, group_size: int, sym: bool = False) -> Int4Linear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features)) * 0.05
    return Int4Linear(quantize_int4(weight, Int4Options(group_size=group_size, sym=sym)), None, module)


def _padded_input(layer: Int4Linear, rows: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, layer.padded_in, generator=torch.Generator().manual_seed(seed))
    x[:, layer.in_features :] = 0  # the layer's padding
    return x


@pytest.mark.parametrize(("out_features", "in_features", "group_size", "sym"), [
    (32, 32, 32, False), (40, 72, 32, False), (96, 128, 64, True), (64, 384, 128, False), (320, 704, 64, False),
])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_matches_its_reference_and_the_stated_bound(module, out_features, in_features, group_size, sym, rows):
    layer = _layer(module, out_features, in_features, group_size, sym)
    x = _padded_input(layer, rows, seed=rows)
    args = (layer.packed, layer.kernel_group, layer.scales_and_zeros)
    y = module.matmul_int4(x, *args)
    assert y.shape == (rows, layer.padded_out) and y.dtype == torch.float32
    reference = reference_matmul_int4(x, *args)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))

    _assert_within_x_rounding(y, x, layer.dequantize(), layer.kernel_group)


@pytest.mark.parametrize(("out_features", "in_features"), [(32, 32), (40, 96), (300, 704), (7, 64)])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_matches_its_reference_and_the_stated_bound(module, out_features, in_features, rows):
    layer = Int8Linear(torch.nn.Linear(in_features, out_features, bias=False), None, module)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    y = module.matmul_int8(x, layer.qweight, layer.scale)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    reference = reference_matmul_int8(x, layer.qweight, layer.scale)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    _assert_within_x_rounding(y, x, layer.qweight.float() * layer.scale[:, None], 32)
    if rows <= INT8_MATMUL_MAX_ROWS:  # the layer runs it; longer inputs go to dequantized tiles
        torch.testing.assert_close(layer(x), y)
    else:
        reference = Int8Linear(torch.nn.Linear(in_features, out_features, bias=False), None)
        reference.load_state_dict(layer.state_dict())
        torch.testing.assert_close(layer(x), reference(x))


def test_bf16_input_gives_bf16_output_and_zero_rows_give_zeros(module):
    layer = _layer(module, 64, 128, 32)
    x = _padded_input(layer, 3, seed=1)
    x[1] = 0  # a group of zeros has scale 0: its codes are 0, not NaN
    y = module.matmul_int4(x.bfloat16(), layer.packed, layer.kernel_group, layer.scales_and_zeros)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    expected = reference_matmul_int4(x.bfloat16().float(), layer.packed, layer.kernel_group, layer.scales_and_zeros)
    torch.testing.assert_close(y.float(), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max()))


def test_int8_refusals_and_zero_rows(module):
    qweight, scale = torch.ones(64, 96, dtype=torch.int8), torch.ones(64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.matmul_int8(torch.randn(1, 80), torch.ones(64, 80, dtype=torch.int8), scale)
    with pytest.raises(RuntimeError, match="disagree on K"):
        module.matmul_int8(torch.randn(1, 64), qweight, scale)
    x = torch.randn(2, 96)
    x[0] = 0
    y = module.matmul_int8(x.bfloat16(), qweight, scale)
    assert y.dtype == torch.bfloat16 and torch.equal(y[0], torch.zeros_like(y[0]))
    torch.testing.assert_close(y[1].float(), int8_codes_dequantized(x.bfloat16(), 32)[1].sum().expand(64),
                               rtol=2**-7, atol=0.0)


def test_bad_shapes_are_refused(module):
    layer = _layer(module, 64, 128, 32)
    args = (layer.packed, layer.kernel_group, layer.scales_and_zeros)
    with pytest.raises(RuntimeError, match="M >= 1"):
        module.matmul_int4(torch.randn(0, 128), *args)
    with pytest.raises(RuntimeError, match="disagree on K"):
        module.matmul_int4(torch.randn(1, 96), *args)
    with pytest.raises(RuntimeError, match="group"):
        module.matmul_int4(torch.randn(1, 128), layer.packed, 48, layer.scales_and_zeros)


def test_int4_layer_takes_the_kernel_up_to_its_row_bound(module):
    """Inputs up to the module's `matmul_int4_max_rows` run the kernel (padding and bias handled by the layer);
    longer ones the dequantized tiles, as without the kernel. The AVX2 form stops at 512 rows; the AVX-512 form has
    no bound."""
    bound = module.matmul_int4_max_rows
    assert bound == (512 if module.target != "avx512" else sys.maxsize)
    layer = _layer(module, 96, 200, 64)  # 200 columns: padded to 256 by the layer, a ragged last group
    layer.bias = torch.nn.Parameter(torch.randn(96), requires_grad=False)
    for rows in (1, 8, 64, 65, 200, 512, 1100):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows))
        if rows > bound:  # the tiles path, which the layer takes without the kernel from 65 rows on
            without = _layer(module, 96, 200, 64)
            without.kernels, without.bias = None, layer.bias
            assert torch.equal(layer(x), without(x))
            continue
        # x as int8 codes: within 1e-5 of the kernel's reference (the exact x @ W.T is orders of magnitude further)
        padded = torch.nn.functional.pad(x, (0, layer.padded_in - 200))
        expected = reference_matmul_int4(padded, layer.packed, layer.kernel_group, layer.scales_and_zeros)[:, :96]
        torch.testing.assert_close(layer(x), expected + layer.bias, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize(("quantization", "kernel"), [("int4", "matmul_int4"), ("int8", "matmul_int8")])
def test_engine_runs_quantized_layers_through_the_kernels(module, make_llm, checkpoint, monkeypatch, quantization,
                                                          kernel):
    """An AVX2-only CPU's int8/int4 models run the integer matmuls; greedy output equals the same model's with
    the kernels' torch references in their place (the loader's seam, exercised on any CPU)."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([6, 21, 3], seed=12)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", lambda: None)
    monkeypatch.setattr(pagoda.kernels, "avx2_kernels", lambda: module)
    llm = make_llm(model_dir, quantization=quantization)
    layer = llm.engine.model.layers[0].mlp.down_proj
    assert (layer.kernels if quantization == "int4" else layer.matmul) is not None
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    reference = ReferenceKernels()
    monkeypatch.setattr(pagoda.kernels, "avx2_kernels", lambda: reference)
    llm = make_llm(model_dir, quantization=quantization)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert reference.called(kernel) > 0


def test_the_startup_summary_names_what_int4_layers_run(make_llm, checkpoint):
    from pagoda.startup import startup_summary

    def quantization_row(llm) -> str:
        summary = startup_summary(llm.engine.describe(), llm.engine.config, "m")
        return next(line for line in summary.splitlines() if "quantization" in line)

    with_kernel = make_llm(checkpoint("llama"), quantization="int4")
    target, _ = pagoda.kernels.simd_target()
    if target == "avx512":
        assert quantization_row(with_kernel).endswith("; pagoda's int4 kernel (x as int8)")
    else:
        assert quantization_row(with_kernel).endswith("; pagoda's int4 kernel up to 512 rows (x as int8), "
                                                      "dequantized tiles beyond")
    if target != "avx512":
        int8 = make_llm(checkpoint("llama"), quantization="int8")
        assert quantization_row(int8).endswith("; pagoda's int8 kernel up to 128 rows (x as int8), dequantized "
                                               "tiles beyond")
    without = make_llm(checkpoint("llama"), quantization="int4", use_kernels=False)
    assert without.engine.model.layers[0].mlp.down_proj.kernels is None
    assert quantization_row(without).endswith("; torch's int4 matmul up to 64 rows, dequantized tiles beyond")
