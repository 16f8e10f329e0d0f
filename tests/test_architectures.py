"""The families beyond Llama's layout (Gemma 2, Gemma 3, OLMo 2, Phi-3): each quirk is live in the test
checkpoints (the reference changes without it), each rope type's tables are transformers' rotary embedding's,
each family runs the implementation it should (the native decode stack, the modules, or the soft-capped
backend), and what pagoda does not implement is refused by name. Greedy equality with transformers under
batching, chunking, preemption and prefix hits is tests/test_correctness.py's, over every architecture."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import compare_with_reference
from test_correctness import MAX_NEW_TOKENS, MODES, PROMPTS, SLIDING_WINDOW, run_greedy
from test_native_decode import CountingStack

from pagoda.kernels import cpu_kernels
from pagoda.model.layers import apply_rotary
from pagoda.model.loader import load_model_config
from pagoda.model.rope_scaling import partial_rotary_order, rope_tables
from pagoda.model_dir import ModelLoadError

LONG_PROMPTS = [p for p in PROMPTS if len(p) > SLIDING_WINDOW]


@pytest.mark.parametrize(("arch", "without"), [
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=16)),
    ("gemma2", dict(layer_types=["full_attention", "full_attention"])),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    ("gemma3", dict(layer_types=["full_attention"] * 3)),
    ("phi3", dict(partial_rotary_factor=1.0, rope_parameters={
        "rope_type": "longrope", "partial_rotary_factor": 1.0, "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})),
])
def test_each_quirk_changes_the_reference(arch, without, checkpoint, hf_reference):
    """Matching transformers is not satisfied by ignoring a quirk: the same weights without it continue the long
    prompts differently."""
    with_quirk = [hf_reference(checkpoint(arch), p, MAX_NEW_TOKENS).token_ids for p in LONG_PROMPTS]
    without_quirk = [hf_reference(checkpoint(arch, **without), p, MAX_NEW_TOKENS).token_ids for p in LONG_PROMPTS]
    assert with_quirk != without_quirk


def test_config_fields_of_each_family(checkpoint):
    gemma2 = load_model_config(checkpoint("gemma2"))
    assert (gemma2.norm_placement, gemma2.norm_unit_offset, gemma2.hidden_act) == ("sandwich", True,
                                                                                  "gelu_pytorch_tanh")
    assert gemma2.sliding_windows == (SLIDING_WINDOW, None) and gemma2.attention_scale == 24**-0.5
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.embedding_multiplier) == (5.0, 8.0,
                                                                                                         8.0)
    gemma3 = load_model_config(checkpoint("gemma3"))
    assert gemma3.attn_logit_softcapping is None and gemma3.qk_norm and gemma3.qk_norm_per_head
    assert gemma3.sliding_rope == (100.0, None) and gemma3.rope_scaling["rope_type"] == "linear"
    olmo2 = load_model_config(checkpoint("olmo2"))
    assert (olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_per_head) == ("post", True, False)
    phi3 = load_model_config(checkpoint("phi3"))
    assert phi3.rotary_dim == 12 and phi3.rope_scaling["rope_type"] == "longrope"


def test_each_family_runs_its_implementation(checkpoint, hf_reference, make_llm):
    """Phi-3 (Llama's layers once its checkpoint is adapted), OLMo 2 (post-norms), Gemma 2 (sandwich norms, GeGLU,
    soft-capped scores, full and sliding layers in KV cache groups of their own) and Gemma 3 (q/k norms, a rope of
    their own for the sliding layers) decode through the native stack; without kernels, the torch backends."""
    expected = {"gemma2": ("SoftCappedCpuAttentionBackend", "SoftCappedAttentionBackend"),
                "gemma3": ("CpuAttentionBackend", "TorchAttentionBackend"),
                "olmo2": ("CpuAttentionBackend", "TorchAttentionBackend"),
                "phi3": ("CpuAttentionBackend", "TorchAttentionBackend")}
    for arch, (with_kernels, without_kernels) in expected.items():
        model_dir = checkpoint(arch)
        llm = make_llm(model_dir, **MODES["chunked"])
        backend = llm.engine.model.backend
        counter = None
        assert type(backend).__name__ == (without_kernels if cpu_kernels() is None else with_kernels)
        if cpu_kernels() is not None:
            counter = backend.decode_runner.stack = CountingStack(backend.decode_runner.stack)
        else:
            assert backend.decode_runner is None
        for index, (tokens, prompt) in enumerate(zip(run_greedy(llm, PROMPTS[:5]), PROMPTS[:5])):
            compare_with_reference(tokens, hf_reference(model_dir, prompt, MAX_NEW_TOKENS), f"{arch}/{index}")
        if counter is not None:
            assert counter.calls >= MAX_NEW_TOKENS - 1, "the native stack must have run the decode steps"


def _hf_rotary(config: transformers.PreTrainedConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(length)[None])
    return cos[0], sin[0]


def _llama_config(rope: dict, max_positions: int = 64, head_dim: int = 16) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=max_positions,
                                    rope_parameters={"rope_theta": 10000.0, **rope})


def _ours(config: transformers.PreTrainedConfig, tmp_path, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pagoda's tables for the config, read from config.json as a checkpoint's would be."""
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    ours = load_model_config(tmp_path)
    return rope_tables(ours.head_dim, ours.rotary_dim or ours.head_dim, length, ours.rope_theta, ours.rope_scaling)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0],
     "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 24.0], "original_max_position_embeddings": 16},
])
def test_rope_tables_are_transformers_rotary_embedding(rope, tmp_path):
    """Within the length the model was trained for, every position's cos and sin are transformers'; past it
    (dynamic, longrope: transformers recomputes them for a longer sequence), each position's are those
    transformers gives it while it decodes that position, a sequence of position + 1 tokens."""
    config = _llama_config(rope)
    threshold = 64 if rope["rope_type"] == "dynamic" else 16
    cos, sin = _ours(config, tmp_path, 100)
    hf_cos, hf_sin = _hf_rotary(config, threshold)
    torch.testing.assert_close(cos[:threshold], hf_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:threshold], hf_sin, rtol=1e-6, atol=1e-6)
    for length in (threshold + 1, 80, 100):
        hf_cos, hf_sin = _hf_rotary(config, length)
        torch.testing.assert_close(cos[length - 1], hf_cos[-1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[length - 1], hf_sin[-1], rtol=1e-6, atol=1e-6)
    if rope["rope_type"] in ("dynamic", "longrope"):  # the scaled set really differs from the plain one
        plain, _ = _ours(_llama_config({"rope_type": "default"}), tmp_path, 100)
        assert not torch.allclose(cos[90], plain[90])


def test_partial_rotary_rotates_as_transformers_once_q_and_k_rows_are_reordered(tmp_path):
    """Phi-3's partial rotary: rope over whole heads, on rows reordered by `partial_rotary_order`, gives
    transformers' rotated dims and passed-through dims, reordered the same way; the dot products are equal."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                     max_position_embeddings=64, partial_rotary_factor=0.75)
    head_dim, rotary_dim, length = 32, 24, 40
    q, k = torch.randn(1, 2, length, head_dim), torch.randn(1, 2, length, head_dim)
    hf_cos, hf_sin = Phi3RotaryEmbedding(config)(q, torch.arange(length)[None])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    order = torch.tensor(partial_rotary_order(head_dim, rotary_dim))
    cos, sin = rope_tables(head_dim, rotary_dim, length, 10000.0, None)
    ours_q = apply_rotary(q[0].transpose(0, 1)[..., order], cos[:, None], sin[:, None])  # [T, heads, D]
    ours_k = apply_rotary(k[0].transpose(0, 1)[..., order], cos[:, None], sin[:, None])
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1)[..., order], rtol=1e-6, atol=1e-6)
    scores = torch.einsum("thd,shd->hts", ours_q, ours_k)
    torch.testing.assert_close(scores, hf_q[0] @ hf_k[0].transpose(-1, -2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "edit", "message"), [
    ("gemma3", {"use_bidirectional_attention": True}, "'use_bidirectional_attention'"),
    ("gemma2", {"hidden_activation": "gelu"}, "'hidden_activation' = 'gelu'"),
    ("olmo2", {"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
    ("phi3", {"partial_rotary_factor": 0.7, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                "partial_rotary_factor": 0.7}},
     "'partial_rotary_factor' = 0.7"),
])
def test_what_a_family_does_not_implement_is_refused_by_name(arch, edit, message, checkpoint, tmp_path):
    config = json.loads((checkpoint(arch) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(tmp_path)


def test_gemma2_logits_are_soft_capped_as_transformers(checkpoint, hf_reference, make_llm):
    """Capping the logits leaves the greedy choice alone (tanh is monotonic), so the capped values are compared:
    pagoda's logprobs are the log-softmax of transformers' capped logits, which stay within the cap."""
    from pagoda import SamplingParams

    model_dir = checkpoint("gemma2")
    prompt = PROMPTS[5]
    reference = hf_reference(model_dir, prompt, MAX_NEW_TOKENS)
    assert reference.logits.abs().max() < 8.0  # final_logit_softcapping of the test checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
    output = make_llm(model_dir, **MODES["all-at-once"]).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    expected = torch.log_softmax(reference.logits, dim=-1)
    for position, (token, logprobs) in enumerate(zip(output.token_ids, output.logprobs)):
        assert token == reference.token_ids[position]
        for token_id, logprob in logprobs.items():
            assert abs(logprob - expected[position, token_id].item()) < 1e-4
