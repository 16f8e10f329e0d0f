"""The quantized KV cache (--kv-cache-dtype int8 | fp8): its layout, its quantizers, and the error it adds.

The error contract: teacher-forced over the same tokens, the logits of a tiny model with int8 or fp8 KV stay
within a bound of the logits with model-dtype KV. The bounds come from measurement on the seeded tiny Llama below
(logits within +-6: int8 0.15, fp8 at scale 1.0 0.79; K/V merely rounded to bf16 0.07) with 2x margin, and a test
shows that a broken dequantization exceeds them: a scale off by 2x or int8 codes read as unsigned by over 15x,
a scale off by 10% by 3x.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

import pagoda.model.kv_cache as kv_cache_module
from pagoda.engine.model_step import ModelExecution, ModelStep
from pagoda.kv_format import FP8_E4M3_MAX
from pagoda.model.attention import QueryLayout
from pagoda.model.kv_cache import LayerKV, dequantize, quantize_fp8, quantize_int8
from pagoda.model.loader import load_model

# The largest |logit difference| from model-dtype KV each format may show over the steps below.
LOGIT_ERROR_BOUND = {"int8": 0.3, "fp8_e4m3": 1.5}
BLOCK_SIZE = 4
STEPS = 8


def run_steps(model, cache_dtype: str, prompts: list[list[int]], forced: torch.Tensor | None = None,
              calculate_kv_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A batched prefill of the prompts, then STEPS batched decodes of `forced` tokens (None: each step's
    greedy choice). Returns the logits [STEPS + 1, B, vocab] and the tokens fed [STEPS, B]."""
    blocks = [-(-(len(prompt) + STEPS) // BLOCK_SIZE) for prompt in prompts]
    execution = ModelExecution(model, sum(blocks), BLOCK_SIZE, cache_dtype=cache_dtype,
                               calculate_kv_scales=calculate_kv_scales)
    tables, first = [], 0
    for count in blocks:
        tables.append(list(range(first, first + count)))
        first += count
    layout, ids, rows = QueryLayout(), [], []
    for prompt, table in zip(prompts, tables):
        layout.add(0, [len(prompt)], table)
        ids += prompt
        rows.append(len(ids) - 1)
    logits = [execution.run(ModelStep(ids, layout, [rows]))[0]]
    fed = []
    for step in range(STEPS):
        tokens = logits[-1].argmax(-1) if forced is None else forced[step]
        fed.append(tokens)
        layout = QueryLayout()
        for prompt, table in zip(prompts, tables):
            layout.add(len(prompt) + step, [1], table)
        logits.append(execution.run(ModelStep(tokens.tolist(), layout, [list(range(len(prompts)))]))[0])
    return torch.stack(logits), torch.stack(fed)


def logit_error(model, cache_dtype: str, prompts: list[list[int]], **options) -> float:
    """Max |logit difference| from model-dtype KV, fed the same (model-dtype greedy) tokens."""
    reference, tokens = run_steps(model, "auto", prompts)
    quantized, _ = run_steps(model, cache_dtype, prompts, tokens, **options)
    return float((quantized - reference).abs().max())


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    model, _ = load_model(checkpoint("llama"), use_kernels=False)
    return model


PROMPTS = random_prompts([5, 23, 40], seed=11)


def test_int8_quantizer_is_symmetric_per_row_and_round_to_nearest():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen) * torch.rand(7, 3, 1, generator=gen) * 10
    x[2, 1] = 0  # an all-zero head: scale 0, codes 0
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (7, 3) and scales.dtype == torch.float32
    torch.testing.assert_close(scales, x.abs().amax(-1) / 127)
    assert int(codes.abs().amax(-1).min()) == 0 and int(codes[2, 1].abs().max()) == 0
    assert (codes.abs().amax(-1)[scales > 0] == 127).all()  # each head's largest value is a full-scale code
    error = (dequantize(codes, scales, torch.float32) - x).abs()
    assert (error <= scales[..., None] / 2 + 1e-6).all()  # rounded to the nearest code


def test_fp8_quantizer_saturates_and_keeps_three_mantissa_bits():
    scale = torch.tensor([0.5])
    x = torch.tensor([0.0, 1.0, -3.3, 100.0, 224.0, 500.0, -1e4])
    codes = quantize_fp8(x, scale)
    assert codes.dtype == torch.float8_e4m3fn
    back = dequantize(codes, scale, torch.float32)
    assert back[-2] == FP8_E4M3_MAX * 0.5 and back[-1] == -FP8_E4M3_MAX * 0.5  # clamped, not NaN
    relative = ((back - x) / x.abs().clamp(min=1e-9))[1:5].abs()
    assert (relative <= 2**-4).all()  # half of e4m3's 2^-3 spacing


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3", "auto"])
def test_layer_kv_is_slot_major_and_moves_a_slot_whole(cache_dtype):
    """Every tensor of a layer's cache has the slot as its first dimension; copying a slot across tensors()
    carries codes and scales together, so the copy reads back as the original token."""
    kv = LayerKV.allocate(12, 2, 16, torch.float32, cache_dtype)
    tensors = kv.tensors()
    assert len(tensors) == (4 if cache_dtype == "int8" else 2)
    assert all(t.shape[0] == 12 for t in tensors)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    kv.write(torch.tensor([3, 7]), k, v)
    kv.copy_slot(7, 10)
    keys, values = kv.gather(torch.tensor([7, 10]), torch.float32)
    assert torch.equal(keys[0], keys[1]) and torch.equal(values[0], values[1])
    tolerance = 0 if cache_dtype == "auto" else 0.08  # int8: amax / 254; fp8: 2^-4 relative at these magnitudes
    torch.testing.assert_close(keys[0], k[1], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_logits_stay_within_the_bound(torch_model, cache_dtype):
    error = logit_error(torch_model, cache_dtype, PROMPTS)
    assert 0 < error < LOGIT_ERROR_BOUND[cache_dtype], f"{cache_dtype}: max |logit error| {error:.4f}"


_dequantize = kv_cache_module.dequantize  # the real one, before a test replaces it


def _scale_doubled(codes, scale, dtype):
    return _dequantize(codes, None if scale is None else scale * 2, dtype)


def _scale_off_by_a_tenth(codes, scale, dtype):
    return _dequantize(codes, None if scale is None else scale * 1.1, dtype)


def _codes_as_unsigned(codes, scale, dtype):
    if codes.dtype != torch.int8:
        return _dequantize(codes, scale, dtype)
    return (codes.view(torch.uint8).float() * scale[..., None]).to(dtype)


@pytest.mark.parametrize(("broken", "factor"), [(_scale_doubled, 10), (_codes_as_unsigned, 10),
                                               (_scale_off_by_a_tenth, 2)])
def test_a_broken_dequantization_exceeds_the_bound(torch_model, monkeypatch, broken, factor):
    """The bound is tight enough to catch a quantizer bug: a wrong reading is well over it, a grossly wrong one
    an order of magnitude over."""
    monkeypatch.setattr(kv_cache_module, "dequantize", broken)
    error = logit_error(torch_model, "int8", PROMPTS)
    assert error > factor * LOGIT_ERROR_BOUND["int8"], f"{broken.__name__}: max |logit error| {error:.4f}"


def test_calculated_fp8_scales_come_from_the_first_prefill(torch_model):
    """--calculate-kv-scales: each layer's K and V scale is amax / 448 of the first K/V written, so that first
    prefill's largest value takes e4m3's largest code; the scales then stay."""
    _, tokens = run_steps(torch_model, "auto", PROMPTS)
    execution = ModelExecution(torch_model, 64, BLOCK_SIZE, cache_dtype="fp8", calculate_kv_scales=True)
    assert all(kv.scales_pending for kv in execution.kv_caches)
    layout = QueryLayout()
    layout.add(0, [len(PROMPTS[2])], list(range(16)))
    execution.run(ModelStep(PROMPTS[2], layout, [[len(PROMPTS[2]) - 1]]))
    written = torch.arange(len(PROMPTS[2]))
    for kv in execution.kv_caches:
        assert not kv.scales_pending and kv.k_scale is not None and kv.v_scale is not None
        assert float(kv.k_scale) != 1.0 and float(kv.v_scale) != 1.0
        for codes in (kv.k, kv.v):
            assert float(codes[written].float().abs().max()) == FP8_E4M3_MAX
    scales = [(float(kv.k_scale), float(kv.v_scale)) for kv in execution.kv_caches]  # type: ignore[arg-type]
    layout = QueryLayout()
    layout.add(0, [len(PROMPTS[1])], list(range(16, 32)))
    execution.run(ModelStep(PROMPTS[1], layout, [[len(PROMPTS[1]) - 1]]))
    assert scales == [(float(kv.k_scale), float(kv.v_scale)) for kv in execution.kv_caches]  # type: ignore[arg-type]
    error = logit_error(torch_model, "fp8", PROMPTS, calculate_kv_scales=True)
    assert 0 < error < LOGIT_ERROR_BOUND["fp8_e4m3"]


def test_prefill_and_decode_read_the_same_quantized_keys(torch_model):
    """A chunked prompt attends to its earlier chunks' dequantized keys, as a whole prompt attends to its own:
    the last chunk's logits match the whole prompt's."""
    prompt = PROMPTS[2]
    whole, chunked = (ModelExecution(torch_model, 16, BLOCK_SIZE, cache_dtype="int8") for _ in range(2))
    layout = QueryLayout()
    layout.add(0, [len(prompt)], list(range(16)))
    expected = whole.run(ModelStep(prompt, layout, [[len(prompt) - 1]]))[0]
    for start, end in ((0, 17), (17, len(prompt))):
        layout = QueryLayout()
        layout.add(start, [end - start], list(range(16)))
        got = chunked.run(ModelStep(prompt[start:end], layout, [[end - start - 1]]))[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
