"""The fused elementwise kernels (kernels/cpu_fused.cpp; simd_fused.cpp on avx2), on every target the CPU
has, against the torch reference they replace.

Rotary + KV write is exact (the same roundings in the same order), quantized KV included (int8 codes and
per-token scales, e4m3 codes: the same bytes as model/kv_cache.py's torch quantizers); residual add is exact;
the norm and the SiLU gate may differ in the last bit of an fp32 reduction or exp, so bf16 outputs may differ by
one bf16 step in a few elements and fp32 by a few ulps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fast_paths import TARGETS, built_kernels, needs_kernels

from pagoda.model.attention import CpuAttentionBackend, TorchAttentionBackend, build_metadata
from pagoda.model.kv_cache import LayerKV
from pagoda.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

pytestmark = needs_kernels
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=TARGETS)
def kernels(request):
    return built_kernels(request.param)


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the last bit of fp32 arithmetic: in bf16, at most one bf16 step, in few elements."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
        return
    differs = int((actual != expected).sum())
    assert differs <= max(1, actual.numel() // 100), f"{differs} of {actual.numel()} elements differ"
    one_step = expected.float().abs() * 2**-7 + 1e-30
    assert ((actual.float() - expected.float()).abs() <= one_step).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 2048), (3, 576), (1, 40), (300, 256)])  # 300 rows: threaded
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_reference(kernels, dtype, rows, width, with_delta):
    torch.manual_seed(rows * width)
    reference = RMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(width))
    fast = RMSNorm(width, eps=1e-6, kernels=kernels).to(dtype)
    fast.load_state_dict(reference.state_dict())
    x = torch.randn(rows, width).mul(3).to(dtype)
    delta = torch.randn(rows, width).to(dtype) if with_delta else None
    x_reference, x_fast = x.clone(), x.clone()
    with torch.inference_mode():
        expected, actual = reference(x_reference, delta), fast(x_fast, delta)
    assert torch.equal(x_fast, x_reference), "the residual add must round exactly as torch's add"
    assert_within_rounding(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 16), (6, 2, 48), (32, 4, 128)])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [37, 1, 5]])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_rotary_and_kv_write_match_reference_exactly(kernels, dtype, heads, kv_heads, head_dim, query_lens,
                                                     cache_dtype):
    torch.manual_seed(head_dim)
    block_size, blocks_per_seq = 16, 4
    seq_lens = [n + 9 for n in query_lens]  # some keys already cached: positions do not start at 0
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))[::-1] for i in range(len(query_lens))]
    meta = build_metadata(query_lens, seq_lens, tables, block_size, {None})
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    cos, sin = rotary.cos_sin(meta.positions, dtype)
    qkv = torch.randn(sum(query_lens), heads + 2 * kv_heads, head_dim).to(dtype)
    caches = []
    for _ in range(2):
        kv = LayerKV.allocate(len(query_lens) * blocks_per_seq * block_size, kv_heads, head_dim, dtype, cache_dtype)
        for tensor in kv.tensors():
            tensor.view(torch.uint8).fill_(7)  # a byte pattern both start from: what is not written stays equal
        if cache_dtype == "fp8_e4m3":
            kv.k_scale.fill_(0.03)  # type: ignore[union-attr]
            kv.v_scale.fill_(0.02)  # type: ignore[union-attr]
        caches.append(kv)
    expected = TorchAttentionBackend().rotate_and_write_kv(qkv.clone(), cos, sin, caches[0], meta, heads)
    actual = CpuAttentionBackend(kernels).rotate_and_write_kv(qkv.clone(), cos, sin, caches[1], meta, heads)
    assert torch.equal(actual, expected)
    for fast, reference in zip(caches[1].tensors(), caches[0].tensors()):
        assert torch.equal(fast.view(torch.uint8), reference.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, intermediate", [(1, 5632), (2, 40), (200, 704)])
def test_silu_gate_matches_reference(kernels, dtype, rows, intermediate):
    torch.manual_seed(intermediate)
    gate_up = torch.randn(rows, 2 * intermediate).mul(4).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # exp's extremes: silu = 0, -0, 100, 0
    gate, up = gate_up.split(intermediate, dim=-1)
    assert_within_rounding(kernels.silu_mul(gate_up), F.silu(gate) * up)


def test_mlp_and_norm_modules_take_the_kernels_only_when_enabled(kernels):
    mlp, norm = GatedMLP(32, 48, bias=False), RMSNorm(32, 1e-5)
    fast_mlp, fast_norm = GatedMLP(32, 48, bias=False, kernels=kernels), RMSNorm(32, 1e-5, kernels=kernels)
    fast_mlp.load_state_dict(mlp.state_dict())
    fast_norm.load_state_dict(norm.state_dict())
    x = torch.randn(2, 32)
    with torch.inference_mode():
        before = mlp(x), norm(x.clone())
        after = fast_mlp(x), fast_norm(x.clone())
    for reference, fast in zip(before, after):
        assert_within_rounding(fast, reference)


def test_fused_kernels_reject_mismatched_inputs(kernels):
    with pytest.raises(RuntimeError, match="delta must match x"):
        kernels.add_rms_norm_(torch.randn(2, 32), torch.randn(3, 32), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        kernels.silu_mul(torch.randn(2, 32, dtype=torch.float64))
    qkv, cache = torch.randn(1, 6, 16), torch.zeros(4, 2, 16)
    with pytest.raises(RuntimeError, match="heads"):
        kernels.rotary_write_kv_(qkv, torch.ones(1, 16), torch.ones(1, 16), cache, cache.clone(),
                                 torch.tensor([0]), 3)
