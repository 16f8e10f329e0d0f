"""The kernels' `lora_add_` (kernels/simd_lora.h) on each target the CPU runs, against the same deltas in torch:
rows of several slots and of the base in one call, ranks below the stack's, a column slice of a wider output,
and widths that leave a tail past the last full vector."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import available_targets, target_kernels

SLOTS, MAX_RANK = 3, 8
ROW_SLOTS = [1, -1, 0, 2, 1, 0, -1]  # every slot, base rows between
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(y, x, a, bt, slots, scaling):
    """y + each row's (scaling * x a[slot]^T) bt[slot] in fp64; a base row (slot -1) unchanged."""
    out = y.double().clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            out[row] += (scaling[row] * x[row].double() @ a[slot].double().T) @ bt[slot].double()
    return out


@pytest.mark.skipif(not available_targets(), reason="this CPU has neither AVX2 + FMA nor AVX-512")
@pytest.mark.parametrize("target", available_targets())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fan_in", "fan_out"), [(64, 48), (77, 133)])
def test_lora_add_matches_torch(target, dtype, fan_in, fan_out):
    kernels = target_kernels(target)
    generator = torch.Generator().manual_seed(fan_in * fan_out)
    a = torch.randn(SLOTS, MAX_RANK, fan_in, generator=generator).to(dtype)
    bt = torch.randn(SLOTS, MAX_RANK, fan_out, generator=generator).to(dtype)
    a[0, 4:], bt[0, 4:] = 0, 0  # slot 0 holds a rank-4 adapter: its rows past the rank are the stack's zeros
    rows = len(ROW_SLOTS)
    x = torch.randn(rows, fan_in, generator=generator).to(dtype)
    wide = torch.randn(rows, fan_out + 16, generator=generator).to(dtype)
    before = wide.clone()
    slots = torch.tensor(ROW_SLOTS, dtype=torch.long)
    scaling = torch.tensor([[0.5, 2.0, 1.25][s] if s >= 0 else 0.0 for s in ROW_SLOTS], dtype=torch.float32)
    expected = reference(wide[:, 8:8 + fan_out], x, a, bt, ROW_SLOTS, scaling)

    kernels.lora_add_(wide[:, 8:8 + fan_out], x, a, bt, slots, scaling)

    got = wide[:, 8:8 + fan_out].double()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + fan_out:], before[:, 8 + fan_out:])
    base_rows = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    assert torch.equal(wide[base_rows], before[base_rows]), "a base row must come out as it went in"


@pytest.mark.skipif(not available_targets(), reason="this CPU has neither AVX2 + FMA nor AVX-512")
def test_lora_add_refuses_a_slot_past_the_stack():
    kernels = target_kernels(available_targets()[0])
    a, bt = torch.zeros(2, 4, 32), torch.zeros(2, 4, 16)
    with pytest.raises(RuntimeError, match="past the stack"):
        kernels.lora_add_(torch.zeros(1, 16), torch.zeros(1, 32), a, bt, torch.tensor([2]), torch.ones(1))
