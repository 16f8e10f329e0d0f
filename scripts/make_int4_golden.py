"""Regenerate tests/data/int4_golden/*.safetensors: small GPTQ and AWQ layers packed and dequantized by the
formats' own reference implementations, so pagoda's unpacking is checked against code it does not mirror.

Runs in its own virtual environment with Python 3.11 (auto-gptq 0.7.1 ships a cp311 wheel), outside the
repository (the packages are not pagoda dependencies):

    python3.11 -m venv /tmp/q4ref
    /tmp/q4ref/bin/pip install torch==2.13.0 safetensors numpy transformers==5.24.0 psutil
    /tmp/q4ref/bin/pip install --no-deps autoawq==0.2.9 auto-gptq==0.7.1 accelerate==1.15.0
    /tmp/q4ref/bin/python scripts/make_int4_golden.py

The committed fixtures were produced with autoawq 0.2.9, auto-gptq 0.7.1 (manylinux wheel; its CUDA
extension is not needed: the CPU path packs and dequantizes in torch), torch 2.13.0+cpu, transformers 5.24.0.

What each reference contributes:
- AWQ: AutoAWQ's WQLinear_GEMM.from_linear packs, awq.utils.packing_utils.dequantize_gemm dequantizes.
- GPTQ v1: AutoGPTQ's qlinear_cuda.QuantLinear.pack packs; its own torch forward on an identity input
  dequantizes (the CPU fallback unpacks qweight/qzeros, adds 1 to the zeros and applies g_idx).
- GPTQ v2: GPTQModel 7.7.0's v1 -> v2 conversion (gptqmodel/utils/model.py,
  convert_gptq_v1_to_v2_format_module), which adds one to every packed zero nibble with a single integer
  addition, reproduced in gptqmodel_v1_to_v2 below; GPTQModel itself needs far more than a CPU venv to import.

Expected weights are dequantized in fp32 from fp16 scales: (code - zero) * scale is then exact, so the tests
compare for equality. Each file holds the checkpoint tensors (qweight, qzeros, scales, g_idx for GPTQ), the
reference's dequantized weight `expected` [out, in] fp32, and the codes the layer was built from `codes`
[out, in] uint8; its metadata names the method, checkpoint format, group size and producer. Reruns reproduce
every tensor bit for bit; only the order of the metadata keys in the file header may change.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "int4_golden"


def import_without_package_init(name: str) -> None:
    """Register `name` as a bare package so its submodules import without its __init__ (which pulls in the
    model zoos, datasets and CUDA kernels that packing does not need)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations is not None, name
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = package


import_without_package_init("awq")
import_without_package_init("auto_gptq")
from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear as AutoGPTQQuantLinear  # noqa: E402
from awq.modules.linear.gemm import WQLinear_GEMM  # noqa: E402
from awq.utils.packing_utils import dequantize_gemm  # noqa: E402


def producer(*packages: str) -> str:
    return ", ".join(f"{p} {importlib.metadata.version(p)}" for p in packages) + f", torch {torch.__version__}"


def random_scales(generator: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Positive fp16-representable scales (as fp32), so (code - zero) * scale is exact in fp32."""
    return (torch.rand(shape, generator=generator) * 0.05 + 0.001).half().float()


def linear_from_codes(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor):
    """An nn.Linear whose weight the packers quantize back to exactly `codes` (zeros, scales: [out, groups])."""
    weight = (codes.float() - zeros[:, g_idx]) * scales[:, g_idx]
    linear = torch.nn.Linear(codes.shape[1], codes.shape[0], bias=False)
    linear.weight.data = weight
    return linear


def awq_case(name: str, in_features: int, out_features: int, group_size: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    zeros = torch.randint(0, 16, (out_features, groups), generator=generator).float()
    zeros[0, 0], zeros[1, 0] = 0, 15  # both ends of the range
    scales = random_scales(generator, (out_features, groups))
    linear = linear_from_codes(codes, zeros, scales, torch.arange(in_features) // group_size)
    # from_linear takes scales and zeros as [groups, out].
    packed = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales.T.contiguous(), zeros=zeros.T.contiguous())
    expected = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size).T
    tensors = {
        "qweight": packed.qweight,
        "qzeros": packed.qzeros,
        "scales": packed.scales.half(),
        "expected": expected.float().contiguous(),
        "codes": codes.to(torch.uint8),
    }
    metadata = {"method": "awq", "version": "gemm", "group_size": str(group_size), "producer": producer("autoawq")}
    save_file(tensors, OUT / f"{name}.safetensors", metadata=metadata)


def autogptq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, group_size: int):
    """AutoGPTQ's packed layer (v1: zeros stored minus one) and its own fp32 dequantization [out, in]."""
    out_features, in_features = codes.shape
    module = AutoGPTQQuantLinear(4, group_size, in_features, out_features, bias=False)
    linear = linear_from_codes(codes, zeros, scales, g_idx)
    module.pack(linear, scales.clone(), zeros.clone(), g_idx=g_idx.to(torch.int32))
    scales_fp16 = module.scales.half()
    module.scales = scales_fp16.float()  # dequantize in fp32: the identity input then reads out exact weights
    expected = module(torch.eye(in_features)).T.contiguous()
    return module.qweight, module.qzeros, scales_fp16, module.g_idx, expected


def gptq_case(
    name: str,
    in_features: int,
    out_features: int,
    group_size: int,
    seed: int,
    *,
    sym: bool = False,
    act_order: bool = False,
    zero_zero_columns: tuple[int, ...] = (),
) -> None:
    generator = torch.Generator().manual_seed(seed)
    size = in_features if group_size == -1 else group_size
    groups = in_features // size
    g_idx = torch.arange(in_features) // size
    if act_order:  # act-order: every group keeps its size, its columns scattered over the input
        g_idx = g_idx[torch.randperm(in_features, generator=generator)]
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    if sym:
        zeros = torch.full((out_features, groups), 8.0)
    else:
        zeros = torch.randint(1, 16, (out_features, groups), generator=generator).float()
        zeros[:, 0][list(zero_zero_columns)] = 0  # v1 stores 0 - 1: it overflows
    scales = random_scales(generator, (out_features, groups))
    qweight, qzeros, scales_fp16, stored_g_idx, expected = autogptq_pack(codes, zeros, scales, g_idx, size)
    tensors = {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales_fp16,
        "g_idx": stored_g_idx,
        "expected": expected,
        "codes": codes.to(torch.uint8),
    }
    metadata = {
        "method": "gptq",
        "checkpoint_format": "gptq",
        "group_size": str(group_size),
        "sym": str(sym),
        "desc_act": str(act_order),
        "producer": producer("auto-gptq"),
    }
    save_file(tensors, OUT / f"{name}.safetensors", metadata=metadata)


def gptqmodel_v1_to_v2(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQModel 7.7.0's 4-bit int32 v1 -> v2 zero conversion (lossless when no v1 nibble holds 15)."""
    return qzeros + 0b00010001000100010001000100010001


def gptq_v2_case(name: str, v1_name: str) -> None:
    from safetensors.torch import load_file

    v1 = load_file(OUT / f"{v1_name}.safetensors")
    stored = (v1["qzeros"].unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
    assert int(stored.max()) < 15, "the v1 -> v2 conversion carries into the next nibble from a stored 15"
    tensors = dict(v1, qzeros=gptqmodel_v1_to_v2(v1["qzeros"]))
    metadata = {
        "method": "gptq",
        "checkpoint_format": "gptq_v2",
        "group_size": "32",
        "sym": "False",
        "desc_act": "False",
        "producer": producer("auto-gptq") + f"; v1 -> v2 as in gptqmodel 7.7.0, from {v1_name}",
    }
    save_file(tensors, OUT / f"{name}.safetensors", metadata=metadata)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    awq_case("awq_in64_out32_g32", 64, 32, 32, seed=1)
    awq_case("awq_in32_out64_g16", 32, 64, 16, seed=2)
    gptq_case("gptq_v1_sym_in64_out32_g32", 64, 32, 32, seed=3, sym=True)
    gptq_case("gptq_v1_asym_in64_out32_g32", 64, 32, 32, seed=4)
    gptq_case("gptq_v1_actorder_in64_out32_g16", 64, 32, 16, seed=5, act_order=True)
    gptq_case("gptq_v1_rowgroup_in64_out32", 64, 32, -1, seed=6)
    # Zero point 0 in column 7 (the top nibble of its word) and column 2 (a lower nibble: AutoGPTQ's packer
    # ORs the sign-extended -1 into every nibble above it, and its reader sees 16 wherever 15 is stored).
    gptq_case("gptq_v1_zero0_in64_out32_g32", 64, 32, 32, seed=7, zero_zero_columns=(7, 2))
    gptq_v2_case("gptq_v2_asym_in64_out32_g32", "gptq_v1_asym_in64_out32_g32")
    for path in sorted(OUT.glob("*.safetensors")):
        print(f"{path.name}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
