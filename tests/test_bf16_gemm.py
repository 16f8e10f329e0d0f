"""On a CPU without bf16 arithmetic (or PAGODA_SIMD_TARGET=avx2 standing in for one), a bf16 model's GEMMs run
in fp32 a tile of W at a time: torch's bf16 GEMM there emulates bf16 at a fifth of the fp32 rate."""

from __future__ import annotations

import os
import platform

import pytest
import torch
from torch import nn

from pagoda.kernels import NATIVE_BF16_CPU_FLAGS, TARGET_ENV, cpu_flags, cpu_lacks_native_bf16
from pagoda.model import quantization
from pagoda.model.quantization import DenseLinear, Int8Linear
from pagoda.model.tiled_matmul import TILE_ROWS, gemm_dtype, tiled_matmul

x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 CPU flags")


@x86
def test_the_cpu_flags_or_the_forced_avx2_target_decide(monkeypatch):
    monkeypatch.delenv(TARGET_ENV, raising=False)
    assert cpu_lacks_native_bf16() == (not NATIVE_BF16_CPU_FLAGS & cpu_flags())
    monkeypatch.setenv(TARGET_ENV, "avx2")
    assert cpu_lacks_native_bf16()
    assert gemm_dtype(torch.bfloat16) == torch.float32
    assert gemm_dtype(torch.float32) == torch.float32


@x86
def test_tiles_reach_the_gemm_in_fp32_and_the_result_in_bf16(monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "avx2")
    torch.manual_seed(0)
    weight = torch.randn(TILE_ROWS + 40, 96).bfloat16()
    x = torch.randn(80, 96).bfloat16()
    asked: list[torch.dtype] = []

    def rows(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        asked.append(dtype)
        return weight[start:end].to(dtype)

    y = tiled_matmul(x, weight.shape[0], rows)
    assert asked == [torch.float32, torch.float32] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.float() @ weight.float().t()).bfloat16(), rtol=0, atol=0)


@x86
@pytest.mark.parametrize("layer_type", [DenseLinear, Int8Linear])
def test_prefill_sized_bf16_inputs_never_meet_a_bf16_gemm(monkeypatch, layer_type):
    monkeypatch.setenv(TARGET_ENV, "avx2")
    torch.manual_seed(0)
    linear = nn.Linear(128, 96).to(torch.bfloat16)  # a bf16 model's layer, quantized or not
    layer = layer_type(linear, kernels=None)
    gemm_inputs: list[torch.dtype] = []
    real_linear, real_mm = quantization.F.linear, torch.mm

    def spy_linear(x, *args, **kwargs):
        gemm_inputs.append(x.dtype)
        return real_linear(x, *args, **kwargs)

    def spy_mm(x, *args, **kwargs):
        gemm_inputs.append(x.dtype)
        return real_mm(x, *args, **kwargs)

    monkeypatch.setattr(quantization.F, "linear", spy_linear)
    monkeypatch.setattr(torch, "mm", spy_mm)
    x = torch.randn(100, 128).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and gemm_inputs and set(gemm_inputs) == {torch.float32}
    reference = linear.float()(x.float())
    torch.testing.assert_close(y.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


def test_a_forced_avx2_run_holds_torch_to_avx2_too(monkeypatch):
    from pagoda.kernels import TORCH_ISA_CAPS, cap_torch_isa

    for name in TORCH_ISA_CAPS["avx2"]:
        monkeypatch.setenv(name, "")  # recorded, so that what cap_torch_isa sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")  # set by the user: kept
    monkeypatch.setenv(TARGET_ENV, "avx2")
    cap_torch_isa()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "SSE41"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
