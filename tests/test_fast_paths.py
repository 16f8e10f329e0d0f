"""The fast CPU paths (bf16 weights, int8 weight-only, native GEMV kernels) against the references.

bf16 and int8 do not promise fp32's exact tokens; their contract is bounded error against fp32
(measured here on prompt logprobs) and, with the kernels, agreement with the torch path of the same
dtype up to accumulation order.
"""

from __future__ import annotations

import platform
import statistics
from pathlib import Path

import pytest
import torch
from conftest import random_prompts
from kernel_spy import KernelSpy, spy_on_engine_kernels
from reference_kernels import ReferenceKernels
from torch import nn

from pagoda import SamplingParams
from pagoda.kernels import TARGETS as ALL_TARGETS
from pagoda.kernels import available_targets, cpu_flags, target_kernels
from pagoda.model.kv_cache import LayerKV
from pagoda.model.quantization import KERNEL_MAX_ROWS, DenseLinear, Int8Linear

# The kernel tests run each target this CPU has, and skip (saying why) where it has none: a test that compares
# a kernel path with torch and ran torch on both sides would prove nothing. Each one asserts the kernel ran.
TARGETS = available_targets()
needs_kernels = pytest.mark.skipif(not TARGETS, reason="this CPU has neither AVX2 + FMA nor AVX-512: no kernels")
needs_prefill_kernels = pytest.mark.skipif("avx512" not in TARGETS,
                                           reason="prefill attention is an avx512-target kernel; this CPU lacks it")


def x_codes(target: str) -> tuple[int, int]:
    """How a target's int8 GEMV codes x: (columns a block, levels); the portable targets' is their integer matmul."""
    return (128, 32767) if target == "avx512" else (32, 127)


def built_kernels(target: str):
    module = target_kernels(target)
    assert module is not None, f"the CPU runs the {target} target, so its kernels must build"
    assert module.target == target
    return module


def test_the_kernel_tests_run_every_target_the_cpu_has():
    """The skips above hide nothing: /proc/cpuinfo, read here on its own, names the targets the CPU can run, and
    each of them is one the kernel tests run and whose module builds (PAGODA_DISABLE_KERNELS=1 fails here)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")),
                     []))
    machine = platform.machine().lower()
    runnable = [name for name, build in ALL_TARGETS.items() if machine in build.machines and build.cpu_flags <= flags]
    assert runnable == TARGETS
    for target in runnable:
        built_kernels(target)


@pytest.fixture(scope="module", params=TARGETS)
def kernels(request):
    return built_kernels(request.param)


@pytest.fixture(scope="module", params=[target for target in TARGETS if target == "avx512"])
def prefill_kernels(request):
    """The targets with prefill attention."""
    return built_kernels(request.param)


@needs_kernels
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 13, 32, 64])  # 13: a group of 8 rows, then 5
def test_gemv_kernels_match_torch(kernels, kind, rows):
    """K = 1,056: several K chunks (the slice of x kept in L1) and a 32-wide tail; N = 203: several
    weight tiles a thread, and not a multiple of the runs one row of x walks side by side, nor of the
    weight rows a group of x takes at once (a remainder on every thread)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 1056)
    if kind == "int8":
        q, scale = torch.randint(-127, 128, (203, 1056), dtype=torch.int8), torch.rand(203) / 50
        actual, expected = kernels.gemv_int8(x, q, scale), (x @ q.float().T) * scale
        # x quantized per block (int16 per 128 on avx512, int8 per 32 on the others): within half a step of each
        # block
        bound = _x_rounding_bound(x, q, scale, *x_codes(kernels.target))
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3 + bound)
        return
    elif kind == "bf16":
        w = torch.randn(203, 1056).bfloat16()
        actual, expected = kernels.gemv_bf16(x, w), x.bfloat16().float() @ w.float().T
    else:
        w = torch.randn(203, 1056)
        actual, expected = kernels.gemv_fp32(x, w), x @ w.T
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3)


def _x_rounding_bound(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int, levels: int) -> float:
    """The most x quantized per `block`-element block of a row (step max|block| / levels, rounded to nearest)
    can move x @ (q * scale).T: half a step times |w|, summed; the largest over rows."""
    half_steps = torch.stack([
        torch.cat([b.abs().max().expand(b.numel()) for b in row.float().split(block)]) / levels / 2 for row in x
    ])
    return (half_steps @ (q.float().abs() * scale[:, None]).T).max().item()


@needs_kernels
def test_int8_one_row_keeps_each_block_of_x_precise(kernels):
    """An outlier in x coarsens only its own block (128 elements on avx512, 32 on avx2): the weights meeting it
    are zero here, so the rest must come out as precise as their own small values allow (one step for all of x:
    ~100x off)."""
    torch.manual_seed(1)
    x = torch.randn(1, 512) * 1e-3
    x[0, 5] = 1000.0
    x[0, 256:384] = 0.0  # a block of zeros
    q, scale = torch.randint(-127, 128, (64, 512), dtype=torch.int8), torch.rand(64) / 50
    q[:, :128] = 0  # the outlier's block, on either target
    actual, expected = kernels.gemv_int8(x, q, scale), (x.double() @ q.double().T * scale.double()).float()
    block, levels = x_codes(kernels.target)
    bound = _x_rounding_bound(x, q, scale, block, levels)
    one_step_for_the_row = ((q.float().abs() * scale[:, None]).sum(dim=1) * 1000 / levels / 2).max().item()
    assert bound < one_step_for_the_row / 1000  # so the check below tells the two apart
    torch.testing.assert_close(actual, expected, rtol=0, atol=bound)


@needs_kernels
def test_kernels_reject_shapes_they_do_not_handle(kernels):
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gemv_bf16(torch.randn(1, 48), torch.randn(8, 48).bfloat16())
    too_many = kernels.gemv_max_rows + 1
    with pytest.raises(RuntimeError, match=f"1..{too_many - 1} rows"):
        kernels.gemv_bf16(torch.randn(too_many, 64), torch.randn(8, 64).bfloat16())


@needs_kernels
@pytest.mark.parametrize(("layer_type", "dtype", "tolerance"), [
    (DenseLinear, torch.float32, 1e-5), (DenseLinear, torch.bfloat16, 2e-2), (Int8Linear, torch.bfloat16, 2e-2),
])
@pytest.mark.parametrize("rows", [1, 8, 20, 40, 70, 300, 600])  # above the kernels' gemv_max_rows: torch
def test_fast_linear_layers_agree_with_and_without_kernels(kernels, layer_type, dtype, tolerance, rows):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    x = torch.randn(rows, 128).to(dtype)
    layer = linear if layer_type is Int8Linear else nn.Linear(128, 96).to(dtype)
    if layer is not linear:
        layer.load_state_dict({k: v.to(dtype) for k, v in linear.state_dict().items()})
    reference = layer_type(layer, kernels=None)
    spy = KernelSpy(kernels)
    fast = layer_type(layer, kernels=spy)
    fast_y = fast(x).float()
    # The kernel runs exactly where the layer's row bound sends x to it; beyond, torch (a routing check).
    takes = rows <= (fast.max_rows if layer_type is DenseLinear else KERNEL_MAX_ROWS)
    assert spy.total() == int(takes), f"{rows} rows: kernel calls {dict(spy.calls)}, expected {int(takes)}"
    torch.testing.assert_close(fast_y, reference(x).float(), rtol=tolerance, atol=tolerance)
    # And both stay close to the fp32 layer they replace.
    error = (fast_y - linear(x.float())).abs().max().item()
    assert error < 0.05 * linear(x.float()).abs().max().item()


@needs_kernels
def test_kernels_skip_layers_whose_width_they_do_not_take(kernels):
    """An input width that is not a multiple of 32 goes to torch instead of failing in the kernel."""
    linear = nn.Linear(48, 16)
    spy = KernelSpy(kernels)
    for layer in (DenseLinear(linear, spy), Int8Linear(linear, spy)):
        torch.testing.assert_close(layer(torch.ones(2, 48)), linear(torch.ones(2, 48)), atol=0.05, rtol=0.05)
    assert spy.total() == 0, f"a kernel ran on a width it does not take: {dict(spy.calls)}"


def test_int8_quantization_is_per_channel_symmetric():
    linear = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.linspace(-2, 2, 256).view(4, 64))
    layer = Int8Linear(linear, kernels=None)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max().item() == 127
    torch.testing.assert_close(layer.scale, linear.weight.abs().amax(dim=1) / 127)
    dequantized = layer.qweight.float() * layer.scale[:, None]
    assert (dequantized - linear.weight).abs().max().item() <= layer.scale.max().item() / 2 + 1e-6


def _prompt_logprobs(llm, prompts) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    values = []
    for prompt, output in zip(prompts, outputs):
        values += [lp[token] for token, lp in zip(prompt[1:], output.prompt_logprobs[1:])]
    return values


@pytest.mark.parametrize(("dtype", "quantization", "max_mean_error"), [
    ("bfloat16", None, 0.05),
    ("bfloat16", "int8", 0.08),
    ("float32", "int8", 0.06),
    ("float32", "int4", 0.9),
])
def test_low_precision_logprob_error_is_bounded(make_llm, checkpoint, dtype, quantization, max_mean_error):
    """The numerics contract: mean |logprob error| against fp32 stays small.

    Measured at about 0.6 of each bound: the tiny test models have wide logits."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([9, 23, 40])
    reference = _prompt_logprobs(make_llm(model_dir), prompts)
    fast = _prompt_logprobs(make_llm(model_dir, dtype=dtype, quantization=quantization), prompts)
    errors = [abs(a - b) for a, b in zip(reference, fast)]
    assert statistics.mean(errors) < max_mean_error, f"mean {statistics.mean(errors):.4f}, max {max(errors):.4f}"
    assert max(errors) < 10 * max_mean_error


@needs_kernels
@pytest.mark.parametrize("target", TARGETS)
def test_decode_kernel_path_agrees_with_torch_path(make_llm, checkpoint, monkeypatch, target):
    """bf16 decode through the kernels and through torch pick the same tokens (or diverge at a near-tie)."""
    model_dir = checkpoint("qwen3")
    prompts = random_prompts([5, 17, 31], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    spy = spy_on_engine_kernels(monkeypatch, target)
    with_kernels = make_llm(model_dir, dtype="bfloat16", use_kernels=True).generate(prompts, params)
    kernel_calls = spy.total()
    torch_only = make_llm(model_dir, dtype="bfloat16", use_kernels=False).generate(prompts, params)
    # Each decode step of the kernel engine ran the native stack or the modules' bf16 GEMVs; the torch engine none.
    assert spy.total("DecodeStack.forward", "gemv_bf16") >= params.max_tokens - 1, dict(spy.calls)
    assert spy.total() == kernel_calls, "the torch-only engine called a kernel"
    for fast, slow in zip(with_kernels, torch_only):
        fast_ids, slow_ids = fast.outputs[0].token_ids, slow.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(fast_ids, slow_ids)) if a != b), None)
        if same is None:
            continue
        # Divergence is only allowed where the torch path's top two choices were nearly tied (bf16 scale).
        top = sorted(slow.outputs[0].logprobs[same].values(), reverse=True)
        assert len(top) >= 2 and top[0] - top[1] < 0.05, f"diverged at {same} without a near-tie: {top[:2]}"


def test_unknown_quantization_is_rejected(checkpoint):
    from pagoda import LLM

    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        LLM(str(checkpoint("llama")), quantization="int3", num_kv_blocks=16)


# Pools small enough that these prompts preempt, yet large enough for one whole sequence: a sliding-window group
# frees what its window dropped (mistral's need less), and qwen2-swa's full and sliding groups share the pool.
PREEMPTING_POOL = {"mistral": 16, "qwen2-swa": 32, "llama-mqa": 24}


@needs_kernels
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("arch", sorted(PREEMPTING_POOL))
def test_paged_attention_kernel_matches_reference_backend(make_llm, checkpoint, monkeypatch, arch, target):
    """fp32 greedy decode through the native paged-attention kernel and through the torch reference
    backend agree token for token (sliding windows and MQA included), with chunking and preemption."""
    model_dir = checkpoint(arch)
    prompts = random_prompts([3, 30, 47, 12], seed=7)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = {"max_num_batched_tokens": 9, "num_kv_blocks": PREEMPTING_POOL[arch]}
    spy = spy_on_engine_kernels(monkeypatch, target)
    fast = make_llm(model_dir, **options)
    reference = make_llm(model_dir, use_kernels=False, **options)
    assert type(fast.engine.model.backend).__name__ == "CpuAttentionBackend"
    assert type(reference.engine.model.backend).__name__ == "TorchAttentionBackend"
    fast_ids = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    kernel_calls = spy.total()
    reference_ids = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    # Prompts wrote their keys through the kernel; decodes attended through it, alone or in the native stack.
    assert spy.calls["rotary_write_kv_"] > 0, dict(spy.calls)
    assert spy.total("paged_decode_attention", "DecodeStack.forward") >= params.max_tokens - 1, dict(spy.calls)
    assert spy.total() == kernel_calls, "the reference engine called a kernel"
    assert fast_ids == reference_ids
    assert fast.engine.scheduler.num_preemptions > 0


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (9, 3, 64), (16, 2, 128), (8, 1, 32)])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("softcap", [None, 1.5])  # 1.5: below the scores' spread, so tanh bends them
def test_paged_decode_kernel_matches_torch_decode(kernels, dtype, heads, kv_heads, head_dim, window, cache_dtype,
                                                  softcap):
    """The kernel against the reference decode on scattered slots, lengths on and off 16-key blocks, on a cache in
    the model's dtype or quantized (the kernel widening codes in registers, the reference dequantizing the keys
    it gathers), with scores soft-capped or not."""
    from pagoda.model.attention import CpuAttentionBackend, TorchAttentionBackend, build_metadata
    from pagoda.model.softcap_attention import SoftCappedAttentionBackend, SoftCappedCpuAttentionBackend

    gen = torch.Generator().manual_seed(heads * head_dim)
    block_size, seq_lens = 4, [1, 15, 16, 17, 40, 75]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        tables.append(order[: -(-n // block_size)])
        order = order[len(tables[-1]) :]
    meta = build_metadata([1] * len(seq_lens), seq_lens, tables, block_size, {window})
    k_cache, v_cache = (torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    kv = LayerKV.allocate(num_blocks * block_size, kv_heads, head_dim, dtype, cache_dtype)
    if cache_dtype == "fp8_e4m3":
        kv.k_scale.fill_(0.02)  # type: ignore[union-attr]
        kv.v_scale.fill_(0.01)  # type: ignore[union-attr]
    kv.write(torch.arange(num_blocks * block_size), k_cache, v_cache)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    args = (q, kv, meta, head_dim**-0.5, window)
    if softcap is None:
        fast = CpuAttentionBackend(kernels).forward(*args).float()
        reference = TorchAttentionBackend().forward(*args).float()
    else:
        fast = SoftCappedCpuAttentionBackend(kernels, softcap).forward(*args).float()
        reference = SoftCappedAttentionBackend(softcap).forward(*args).float()
    # bf16: the output's own rounding. int8 on the avx512 target: each query rounded to int16 for the integer dot
    # products (2^-16 of its largest element), far below the codes' own error but above fp32's.
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4 if cache_dtype == "int8" else 1e-5
    torch.testing.assert_close(fast, reference, atol=tolerance, rtol=tolerance)


@needs_prefill_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 2, 128), (8, 1, 32), (6, 6, 96)])
@pytest.mark.parametrize("window", [None, 13, 70])
def test_paged_prefill_kernel_matches_fp32_attention(prefill_kernels, dtype, heads, kv_heads, head_dim, window):
    """The prefill kernel in a mixed step (whole prompts, chunks that follow cached keys, decodes) on
    scattered slots, against the reference backend computing in fp32 on the same values."""
    from pagoda.model.attention import CpuAttentionBackend, TorchAttentionBackend, build_metadata

    gen = torch.Generator().manual_seed(heads * head_dim + (window or 0))
    block_size = 4
    query_lens, seq_lens = [1, 70, 5, 33, 130, 1], [17, 70, 5, 100, 200, 64]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        tables.append(order[: -(-n // block_size)])
        order = order[len(tables[-1]) :]
    meta = build_metadata(query_lens, seq_lens, tables, block_size, {window})
    k_cache, v_cache = (torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
                        for _ in range(2))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    fast = CpuAttentionBackend(prefill_kernels).forward(q, LayerKV(k_cache, v_cache), meta, head_dim**-0.5,
                                                        window).float()
    reference = TorchAttentionBackend().forward(
        q.float(), LayerKV(k_cache.float(), v_cache.float()), meta, head_dim**-0.5, window
    )
    # bf16: the output's own rounding, and the probabilities' (rounded to bf16 before p @ v, as torch does)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast, reference, atol=tolerance, rtol=tolerance)


@needs_kernels
def test_prefill_attention_takes_amx_tiles_where_the_cpu_has_them(kernels):
    assert kernels.prefill_attention_amx == ({"amx_bf16", "amx_tile"} <= cpu_flags())


@needs_prefill_kernels
@pytest.mark.parametrize("use_amx", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (16, 2, 128), (8, 1, 32), (6, 6, 96)])
@pytest.mark.parametrize("window", [0, 13, 70])
@pytest.mark.parametrize("spread", [1.0, 12.0])  # 12: peaked rows, most probabilities below fp32's range
def test_bf16_prefill_kernel_forms_match_fp32_attention(prefill_kernels, use_amx, heads, kv_heads, head_dim, window,
                                                       spread):
    """Both bf16 forms (AMX tiles where the CPU has them; vdpbf16ps) on a chunk of 150 queries after 170
    cached keys, on scattered slots: 5 key blocks, tiles of rows that straddle query heads and positions."""
    gen = torch.Generator().manual_seed(heads * head_dim + window)
    cached, queries = 170, 150
    slots = torch.randperm(400, generator=gen)[: cached + queries]
    k_cache, v_cache = (torch.randn(400, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    q = (torch.randn(queries, heads, head_dim, generator=gen) * spread).bfloat16()
    out = torch.empty_like(q)
    prefill_kernels.paged_prefill_attention_(q, k_cache, v_cache, slots, window, head_dim**-0.5, out, use_amx=use_amx)
    reference = torch.empty(q.shape)  # the stand-in kernel, computing in fp32 on the same values
    ReferenceKernels().paged_prefill_attention_(q.float(), k_cache.float(), v_cache.float(), slots, window,
                                                head_dim**-0.5, reference)
    # the output's own rounding, and the probabilities' (bf16 before p @ v, as torch's flash kernel)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)


@needs_prefill_kernels
def test_paged_prefill_kernel_rejects_shapes_it_does_not_handle(prefill_kernels):
    q = torch.zeros(4, 4, 48, dtype=torch.bfloat16)
    cache = torch.zeros(8, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 32..128"):
        prefill_kernels.paged_prefill_attention_(q, cache, cache, torch.arange(4), 0, 1.0, torch.empty_like(q))
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        prefill_kernels.paged_prefill_attention_(q, cache.float(), cache.float(), torch.arange(4), 0, 1.0, q)
