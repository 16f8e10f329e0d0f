"""int4 weight-only quantization: the quantizer, the layer's two paths against the codes' own dequantized
weights, torch's packed layout, and the engine with `--quantization int4`.

Bounds: the layer's weights equal `Int4Weights.dequantize()` exactly when symmetric, and within a 2**-8
relative error of each group's offset when not (offsets are stored in bf16); its decode path rounds x to
bf16, so outputs agree with x @ W.T to bf16's precision of the largest product sum (2**-7 relative).
"""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels
from pagoda.int4_format import Int4Options
from pagoda.model.int4 import (
    Int4Linear,
    pack_group_pairs,
    pack_int4,
    quantize_int4,
    torch_int4_block_rows,
    unpack_group_pairs,
    unpack_int4,
)
from pagoda.model.int4_weights import Int4Weights, stack_outputs
from pagoda.sampling import SamplingParams
from tests.conftest import random_prompts


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantizer_codes_and_error(sym, group_size):
    weight = _weights(40, 200)  # 200 = ragged for every group size
    q = quantize_int4(weight, Int4Options(group_size=group_size, sym=sym))
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    assert q.scales.shape == (40, -(-200 // group_size)) and (q.zeros is None) == sym
    assert torch.equal(q.scales, q.scales.bfloat16().float()), "scales are chosen at the precision they are stored"
    assert _relative_error(q.dequantize(), weight) < 0.12  # 4 bits on Gaussian weights: ~0.08-0.1


def test_ragged_last_group_takes_its_statistics_from_its_own_columns():
    weight = _weights(8, 40)
    weight[:, 32:] *= 0.01  # the ragged group (8 real columns) is tiny next to the first
    q = quantize_int4(weight, Int4Options(group_size=32, search=False))
    tail_error = (q.dequantize()[:, 32:] - weight[:, 32:]).abs().max()
    assert tail_error <= q.scales[:, 1].max() / 2 + 1e-9 and q.scales[:, 1].max() < q.scales[:, 0].min() / 10


def test_clipping_search_never_loses_to_round_to_nearest():
    weight = _weights(64, 256, seed=1)
    weight[0, 0] = 1.0  # an outlier that plain min/max would spend the whole grid on
    searched = quantize_int4(weight, Int4Options()).dequantize()
    plain = quantize_int4(weight, Int4Options(search=False)).dequantize()
    per_row = lambda w: ((w - weight) ** 2).sum(1)  # noqa: E731
    assert bool((per_row(searched) <= per_row(plain) + 1e-12).all())
    assert float(per_row(searched).sum()) < float(per_row(plain).sum())


def _random_codes(rows: int, cols: int) -> torch.Tensor:
    return torch.randint(0, 16, (rows, cols), dtype=torch.int32, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("shape", [(32, 64), (48, 100), (70, 256), (1024, 96)])
def test_packer_writes_torchs_layout_for_this_cpu(shape):
    """pack_int4 in torch's block for this CPU equals torch's own converter (padded by the layer to the block)."""
    block = torch_int4_block_rows()
    rows, cols = -(-shape[0] // block) * block, shape[1] + shape[1] % 2
    codes = _random_codes(rows, cols)
    assert torch.equal(pack_int4(codes, block), torch._convert_weight_to_int4pack_for_cpu(codes, 1))


@pytest.mark.parametrize("block", [32, 64])
def test_packed_layout_round_trips(block):
    codes = _random_codes(4 * block, 98)
    packed = pack_int4(codes, block)
    assert packed.shape == (4 * block, 49)
    assert torch.equal(unpack_int4(packed, 4 * block, 98, block), codes.to(torch.uint8))


def test_group_pairs_layouts_round_trip_and_place_each_pair():
    """The kernel's pairs are block-major, pair (row, group) at [row // 32, group, row % 32]; torch's [group, row]."""
    pairs = torch.randn(96, 5, 2, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    kernel, torchs = pack_group_pairs(pairs, 32), pack_group_pairs(pairs, None)
    assert kernel.shape == (3, 5, 32, 2) and torchs.shape == (5, 96, 2)
    assert torch.equal(kernel[70 // 32, 4, 70 % 32].float(), pairs[70, 4])
    assert torch.equal(torchs[4, 70].float(), pairs[70, 4])
    for packed, block_rows in ((kernel, 32), (torchs, None)):
        assert torch.equal(unpack_group_pairs(packed, block_rows).float(), pairs)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"),
                         [(64, 128, 32), (50, 100, 64), (96, 704, 128), (33, 40, 32), (300, 64, 32)])
def test_layer_matches_its_codes(out_features, in_features, group_size, sym):
    q = quantize_int4(_weights(out_features, in_features, seed=3), Int4Options(group_size=group_size, sym=sym))
    reference = q.dequantize()
    bias = torch.randn(out_features)
    layer = Int4Linear(q, bias)
    stored = layer.dequantize()[:out_features, :in_features]
    offset_bound = 0.0 if sym else float(q.scales.max()) * 8 * 2**-8
    assert (stored - reference).abs().max() <= offset_bound
    for rows in (1, 7, 64, 65, 130):  # the int4 kernel up to 64 rows, dequantized tiles + GEMMs beyond
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        expected = x @ reference.T + bias
        tolerance = 2**-7 * float((x.abs() @ reference.abs().T).max()) + offset_bound * float(x.abs().sum(1).max())
        assert float((layer(x) - expected).abs().max()) <= tolerance


def test_act_order_columns_are_gathered_back():
    """A g_idx that scatters columns across groups (GPTQ act-order) computes the same product."""
    weight = _weights(32, 128, seed=4)
    q = quantize_int4(weight, Int4Options(group_size=32, sym=True))
    order = torch.randperm(128, generator=torch.Generator().manual_seed(5))  # column j of the checkpoint ...
    inverse = torch.argsort(order)
    scattered = Int4Weights(codes=q.codes[:, order], scales=q.scales, zeros=None, group_size=32,
                            g_idx=(torch.arange(128) // 32)[order])  # ... is our column order[j]
    assert torch.equal(scattered.dequantize()[:, inverse], q.dequantize())
    layer = Int4Linear(scattered, None)
    x = torch.randn(80, 128)
    torch.testing.assert_close(layer(x), x @ scattered.dequantize().T, atol=1e-4, rtol=1e-4)


def test_whole_row_group_spans_several_kernel_groups():
    """GPTQ's group_size -1 (one group per row) on a 512-wide input: kernel groups of 256 share its scale."""
    q = quantize_int4(_weights(32, 512), Int4Options(group_size=128, sym=True))
    one_group = Int4Weights(codes=q.codes, scales=q.scales[:, :1], zeros=None, group_size=512)
    layer = Int4Linear(one_group, None)
    assert layer.kernel_group == 256
    x = torch.randn(80, 512)
    torch.testing.assert_close(layer(x), x @ one_group.dequantize().T, atol=1e-4, rtol=1e-4)


def test_stacked_outputs_need_one_column_order():
    a = quantize_int4(_weights(32, 64), Int4Options(sym=True))
    b = quantize_int4(_weights(16, 64, seed=1), Int4Options(sym=True))
    stacked = stack_outputs([a, b])
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    reordered = Int4Weights(b.codes, b.scales, None, 32, g_idx=torch.arange(64).flip(0) // 32)
    with pytest.raises(ValueError, match="g_idx"):
        stack_outputs([a, reordered])


@pytest.mark.parametrize(("options", "message"), [
    ({"group_size": 16}, "group_size must be one of"),
    ({"bits": 3}, "unknown int4 option"),
    ({"sym": "yes"}, "sym must be true or false"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Int4Options.from_dict(options)


def test_options_need_int4(checkpoint):
    from pagoda import LLM

    with pytest.raises(ValueError, match="quantization_config applies to --quantization int4 only"):
        LLM(str(checkpoint("llama")), quantization="int8", quantization_config={"group_size": 64}, num_kv_blocks=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_output_does_not_depend_on_batching_or_chunking(make_llm, checkpoint, arch):
    """Greedy int4 output is the same alone, batched, and prefilled in small chunks with preemption."""
    model_dir = checkpoint(arch)
    prompts = random_prompts([5, 19, 40, 33], seed=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [make_llm(model_dir, quantization="int4").generate([p], params)[0].outputs[0].token_ids
             for p in prompts[:2]]
    batched = make_llm(model_dir, quantization="int4", max_num_batched_tokens=7, num_kv_blocks=20)
    outputs = [o.outputs[0].token_ids for o in batched.generate(prompts, params)]
    assert outputs[:2] == alone
    assert batched.engine.scheduler.num_preemptions > 0
    layer = batched.engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Int4Linear) and isinstance(batched.engine.model.lm_head, Int4Linear)


def test_lm_head_left_out_by_option(make_llm, checkpoint):
    llm = make_llm(checkpoint("llama"), quantization="int4", quantization_config={"lm_head": False})
    assert not isinstance(llm.engine.model.lm_head, Int4Linear)
    assert isinstance(llm.engine.model.layers[0].mlp.down_proj, Int4Linear)


def test_int4_decodes_through_the_native_stack_where_its_layers_take_it(make_llm, checkpoint, monkeypatch):
    """Where pagoda's kernels run (their torch stand-ins here), an int4 model decodes through the native decode
    stack, its layers' int4 matmul inside; a layer the stack cannot take whole (act-order's column gather)
    keeps the model on its modules. Greedy tokens are those of the torch path either way."""
    from reference_kernels import ReferenceKernels

    from pagoda.model.native_decode import decode_stack_covers

    model_dir = checkpoint("llama")
    prompts = random_prompts([6, 21], seed=9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_llm(model_dir, quantization="int4").generate(prompts, params)]
    stand_in = ReferenceKernels()
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", lambda: stand_in)
    llm = make_llm(model_dir, quantization="int4")
    assert llm.engine.model.backend.decode_runner is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert stand_in.called("DecodeStack.forward") >= 7
    down = llm.engine.model.layers[0].mlp.down_proj
    down.input_order = torch.arange(down.in_features)  # as an act-order checkpoint's layer has one
    assert not decode_stack_covers(llm.engine.model)
