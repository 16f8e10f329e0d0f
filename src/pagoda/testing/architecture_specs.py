"""The tiny test checkpoints' architectures: for each, the `transformers` config and model classes and the config
fields that make it what it is (testing/checkpoints.py builds them). Data only.
"""

from __future__ import annotations

from typing import Any

_SLIDING_WINDOW = 24  # small, so ~60-token test sequences see tokens drop out of the window

# Mixtures of experts: 4 experts, top 2, at the tiny models' size. Qwen3-MoE renormalises its top-k weights and
# keeps layer 1 dense (`mlp_only_layers`); Qwen2-MoE does not renormalise, and adds its gated shared expert.
_MOE_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"tie_word_embeddings": False, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}),
}

# arch -> (config class, model class, config fields that make the architecture what it is)
ARCH_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            # original_max_position_embeddings=64 with head_dim 16 puts some frequencies in each of
            # llama3's three regimes (kept, smoothed, divided by factor), so scaling really matters.
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {"tie_word_embeddings": False, "sliding_window": _SLIDING_WINDOW},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # Qwen2's own switch: layers >= max_window_layers slide, the ones below attend to everything,
    # so one model mixes full and sliding layers (config.json spells it out in layer_types).
    "qwen2-swa": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"tie_word_embeddings": True, "use_sliding_window": True, "sliding_window": _SLIDING_WINDOW},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False, "head_dim": 32}),
    "llama-mqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"tie_word_embeddings": False, "num_key_value_heads": 1},
    ),
    **_MOE_SPECS,
    # Gemma 2: soft-capping tight enough to bite on these weights (scores and logits reach tens), every other
    # layer sliding, query_pre_attn_scalar not head_dim, so that each quirk changes the output. Untied: with
    # the embedding scaled by sqrt(hidden) as its own LM head, greedy decoding repeats one token.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": _SLIDING_WINDOW, "query_pre_attn_scalar": 24,
         "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0, "tie_word_embeddings": False},
    ),
    # Gemma 3 text: 2 local layers to 1 global (the real 5:1 needs more layers), local rope at its own base.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": _SLIDING_WINDOW, "query_pre_attn_scalar": 24, "num_hidden_layers": 3,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "tie_word_embeddings": False,
         # Rope per layer type: the global layers' scaled (linear, as Gemma 3 4B+), the local ones' own base.
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"tie_word_embeddings": False}),
    # Phi-4-mini's shape of rope: partial (3/4 of each head rotated) with LongRoPE factors, whose long set
    # starts at original_max_position_embeddings = 128, past the test sequences: transformers recomputes a whole
    # sequence with the long set once it crosses, which pagoda does not (model/rope_scaling.py).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"tie_word_embeddings": False, "original_max_position_embeddings": 128, "partial_rotary_factor": 0.75,
         "rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                             "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}},
    ),
}
ARCHITECTURES: tuple[str, ...] = tuple(ARCH_SPECS)
