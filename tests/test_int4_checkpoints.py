"""Whole GPTQ and AWQ checkpoints load and compute what their dequantized weights compute.

A tiny seeded model's linears are quantized (pagoda's quantizer, integer zero points), packed the way each
format stores them, and written as a checkpoint beside a plain fp32 one holding the dequantized weights
(codes, zero points and fp16 scales exactly as stored). The packing here is written from the formats'
descriptions; the unpacking itself is checked against the formats' reference implementations in
test_prequantized.py. Bound: pagoda rounds the fp16 scales to bf16 and decode-sized activations to bf16, so
logits agree to a small fraction of their spread, not bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.int4_format import Int4Options
from pagoda.model.int4 import Int4Linear, quantize_int4
from pagoda.sampling import SamplingParams
from tests.conftest import random_prompts

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds column AWQ_ORDER[k] of its block


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 words, nibble k in bits 4k..4k+3."""
    value = sum(nibbles[..., k].long() << (4 * k) for k in range(8))
    return (value - (value >= 2**31).long() * 2**32).to(torch.int32).contiguous()


def _gptq_tensors(codes, zeros, scales, group_size, v1: bool) -> dict[str, torch.Tensor]:
    out_features, in_features = codes.shape
    stored_zeros = (zeros.long() - 1) & 15 if v1 else zeros.long()
    return {
        "qweight": _words(codes.t().reshape(in_features // 8, 8, out_features).transpose(1, 2)),
        "qzeros": _words(stored_zeros.t().reshape(-1, out_features // 8, 8)),
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(in_features) // group_size).to(torch.int32),
    }


def _awq_tensors(codes, zeros, scales) -> dict[str, torch.Tensor]:
    out_features, in_features = codes.shape
    blocks = codes.t().reshape(in_features, out_features // 8, 8)[..., list(AWQ_ORDER)]
    zero_blocks = zeros.long().t().reshape(-1, out_features // 8, 8)[..., list(AWQ_ORDER)]
    return {"qweight": _words(blocks), "qzeros": _words(zero_blocks), "scales": scales.t().contiguous()}


def _quantized_pair(source: Path, tmp_path: Path, method: str) -> tuple[Path, Path]:
    """(the 4-bit checkpoint, the fp32 checkpoint of its dequantized weights)."""
    quantized_dir, reference_dir = tmp_path / method, tmp_path / f"{method}-dequantized"
    for target in (quantized_dir, reference_dir):
        shutil.copytree(source, target)
        for file in target.glob("*.safetensors"):
            file.unlink()
    tensors = load_file(str(next(source.glob("*.safetensors"))))
    packed, dequantized = {}, {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in QUANTIZED:
            packed[name] = dequantized[name] = tensor
            continue
        q = quantize_int4(tensor, Int4Options(group_size=32, search=False))
        assert q.zeros is not None
        scales = q.scales.half()
        zeros, group_scales = q.zeros.repeat_interleave(32, 1), scales.float().repeat_interleave(32, 1)
        dequantized[name] = (q.codes.float() - zeros) * group_scales
        parts = (_gptq_tensors(q.codes, q.zeros, scales, 32, v1=True) if method == "gptq"
                 else _awq_tensors(q.codes, q.zeros, scales))
        packed.update({f"{prefix}.{part}": value for part, value in parts.items()})
    save_file(packed, str(quantized_dir / "model.safetensors"))
    save_file(dequantized, str(reference_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}
        if method == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm"})
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, reference_dir


def _prompt_logprobs(llm, prompts) -> torch.Tensor:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([lp[token] for prompt, output in zip(prompts, outputs)
                         for token, lp in zip(prompt[1:], output.prompt_logprobs[1:])])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoint_computes_its_dequantized_weights(make_llm, checkpoint, tmp_path, method):
    quantized_dir, reference_dir = _quantized_pair(checkpoint("llama", intermediate_size=128), tmp_path, method)
    prompts = random_prompts([9, 23, 40], seed=11)
    # Kernels off: this checks the weights as loaded, with activations exact where the int4 kernel would
    # quantize them to int8 (its own bound is tests/test_quantized_kernels.py's).
    quantized, reference = make_llm(quantized_dir, use_kernels=False), make_llm(reference_dir)
    assert isinstance(quantized.engine.model.layers[0].self_attn.qkv_proj, Int4Linear)
    assert not isinstance(quantized.engine.model.lm_head, Int4Linear)  # the checkpoint leaves it unquantized
    error = (_prompt_logprobs(quantized, prompts) - _prompt_logprobs(reference, prompts)).abs()
    assert float(error.mean()) < 0.02 and float(error.max()) < 0.2, (float(error.mean()), float(error.max()))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for fast, exact in zip(quantized.generate(prompts, params), reference.generate(prompts, params)):
        fast_ids, exact_ids = fast.outputs[0].token_ids, exact.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(fast_ids, exact_ids)) if a != b), None)
        if first is not None:  # only at a near-tie of the exact weights' top two
            top = sorted(exact.outputs[0].logprobs[first].values(), reverse=True)
            assert top[0] - top[1] < 0.05, f"diverged at {first} without a near-tie: {top[:2]}"


def test_checkpoint_refuses_another_quantization(checkpoint, tmp_path):
    from pagoda import LLM
    from pagoda.model_dir import ModelLoadError

    quantized_dir, _ = _quantized_pair(checkpoint("llama", intermediate_size=128), tmp_path, "gptq")
    with pytest.raises(ModelLoadError, match="holds gptq 4-bit weights; --quantization int8 cannot apply"):
        LLM(str(quantized_dir), quantization="int8", num_kv_blocks=16)
    with pytest.raises(ModelLoadError, match="--quantization-config applies only when pagoda quantizes"):
        LLM(str(quantized_dir), quantization="int4", quantization_config={"group_size": 64}, num_kv_blocks=16)
