"""The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3) from one config-driven implementation, which the
families of model/families.py (Gemma 2/3, OLMo 2, Phi-3) configure too: where the norms sit, the MLP's gate,
q/k norms, soft-capping, scaled embeddings and per-layer rope are ModelConfig fields.

The model takes a flat batch: `input_ids` and `positions` of every scheduled token of every request,
concatenated, plus the step's AttentionMetadata and the paged KV cache. No padding, no batch dim.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.config import ModelConfig
from pagoda.model.attention import AttentionBackend, AttentionMetadata
from pagoda.model.backends import ModelRuntime
from pagoda.model.expert_parallel import ExpertParallelMoeBlock, ExpertPlacement
from pagoda.model.kernel_protocols import CpuKernels
from pagoda.model.kv_cache import LayerKV
from pagoda.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, row_linear
from pagoda.model.moe import SparseMoeBlock, expert_target, is_sparse_layer, moe_row_offsets, split_grouped_experts
from pagoda.model.parallel import TensorParallel, VocabParallelEmbedding
from pagoda.model.pipeline import StageActivations


def fused_row_offsets(config: ModelConfig) -> dict[str, dict[str, int]]:
    """Where each checkpoint projection's rows start inside our fused parameters."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv_proj": {"q": 0, "k": q_size, "v": q_size + kv_size},
        "gate_up_proj": {"gate": 0, "up": config.intermediate_size},
    }


RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin per position


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, kernels: CpuKernels | None,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.window = config.sliding_windows[layer_index] if config.sliding_windows else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = row_linear(self.q_size, config.hidden_size, config.o_proj_bias, parallel)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.qk_norm_per_head = config.qk_norm_per_head
        if config.qk_norm:
            # Per head (Qwen3, Gemma 3), or over the whole q and k projections (OLMo 2).
            q_width, k_width = (config.head_dim, config.head_dim) if config.qk_norm_per_head else (
                self.q_size, self.kv_size)
            offset, fp32_scale = config.norm_unit_offset, config.norm_placement == "post"
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, kernels, offset, fp32_scale)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, kernels, offset, fp32_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: LayerKV,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_per_head:  # OLMo 2
            q_end = self.q_size
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end].contiguous())
            qkv[:, q_end : q_end + self.kv_size] = self.k_norm(qkv[:, q_end : q_end + self.kv_size].contiguous())
        qkv = qkv.view(-1, heads + 2 * kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_per_head:  # norms before rope
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])
            qkv[:, heads : heads + kv_heads] = self.k_norm(qkv[:, heads : heads + kv_heads])
        q = backend.rotate_and_write_kv(qkv, cos, sin, kv_cache, meta, heads)
        attended = backend.forward(q, kv_cache, meta, self.scale, self.window)
        out: torch.Tensor = self.o_proj(attended.reshape(-1, self.q_size))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, kernels: CpuKernels | None,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.norm_placement = config.norm_placement
        eps, offset, fp32_scale = config.rms_norm_eps, config.norm_unit_offset, config.norm_placement == "post"

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, eps, kernels, offset, fp32_scale)

        if config.norm_placement != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_index, kernels, parallel)
        self.post_attention_layernorm = norm()
        if config.norm_placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if config.norm_placement != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp: GatedMLP | SparseMoeBlock
        if is_sparse_layer(config, layer_index) and parallel is not None and parallel.expert_parallel:
            self.mlp = ExpertParallelMoeBlock(config, kernels, parallel)
        elif is_sparse_layer(config, layer_index):
            self.mlp = SparseMoeBlock(config, kernels)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, kernels, parallel,
                                config.hidden_act)
        # Gemma 3's local layers rotate with their own tables (LlamaModel.forward picks them by this).
        self.sliding_rope = config.sliding_rope is not None and self.self_attn.window is not None

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: LayerKV, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """x: the residual stream, to which the previous sublayer's output `delta` is added in place (by
        the norm, fused); returns this layer's MLP output (after its norm, where one follows it), the next
        layer's delta."""
        if self.norm_placement == "post":  # OLMo 2: the sublayers read the stream itself, their outputs normed
            if delta is not None:
                x.add_(delta)
            attended = self.self_attn(x, cos, sin, kv_cache, meta, backend)
            x.add_(self.post_attention_layernorm(attended))
            post_mlp: torch.Tensor = self.post_feedforward_layernorm(self.mlp(x))
            return post_mlp
        attended = self.self_attn(self.input_layernorm(x, delta), cos, sin, kv_cache, meta, backend)
        if self.norm_placement == "sandwich":  # Gemma: each sublayer's output normed before it joins the stream
            mlp_in = self.pre_feedforward_layernorm(x, self.post_attention_layernorm(attended))
            sandwiched: torch.Tensor = self.post_feedforward_layernorm(self.mlp(mlp_in))
            return sandwiched
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(x, attended))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, runtime: ModelRuntime | None = None,
                 max_positions: int | None = None) -> None:
        """runtime: the implementations to run (`backends.create_runtime`); by default the torch reference.
        config: the model's architecture, or with `runtime.parallel` this rank's share of it
        (`parallel.shard_config`)."""
        super().__init__()
        runtime = runtime or ModelRuntime()
        self.config = config
        self.parallel = parallel = runtime.parallel
        stage = runtime.pipeline  # a pipeline stage holds its layers, the first the embedding, the last the head
        # No random init (the checkpoint overwrites it): on the meta device, nn.Embedding's normal_ imports
        # torch._dynamo, which stays resident (~70 MB, six times the built-in model).
        self.embed_tokens: nn.Embedding | None = None
        if (stage is None or stage.is_first) and parallel is None:
            embedding = torch.empty(config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        elif stage is None or stage.is_first:
            assert parallel is not None
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, i, runtime.kernels, parallel)
                                    for i in range(config.num_layers))
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if stage is None or stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, runtime.kernels, config.norm_unit_offset,
                                config.norm_placement == "post")
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, self.max_positions, config.rope_theta, config.rope_scaling,
                                      config.rotary_dim)
        self.sliding_rotary: RotaryEmbedding | None = None
        if config.sliding_rope is not None:
            theta, scaling = config.sliding_rope
            self.sliding_rotary = RotaryEmbedding(config.head_dim, self.max_positions, theta, scaling,
                                                  config.rotary_dim)
        self.backend = runtime.attention
        self.fused_rows = fused_row_offsets(config)
        held = None  # under expert parallelism, this rank's experts: their rows of the grouped tensors
        if config.moe is not None and parallel is not None and parallel.expert_parallel:
            held = ExpertPlacement(parallel.rank, parallel.world_size, config.moe.num_experts).held
        self.expert_rows = moe_row_offsets(config, held)  # the grouped experts' rows, by parameter

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        received: StageActivations | None = None,
    ) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; call compute_logits on the rows to sample. On the last
        pipeline stage of several, `received` is what the stage before handed on (`forward_stage`)."""
        x, delta, cos, sin, sliding = self._stage_input(input_ids, positions, received)
        runner = self.backend.decode_runner
        # fp8 scales still to be calculated are set by the modules' first write (the stack only reads them).
        if (received is None and runner is not None and runner.takes(meta, x.shape[0])
                and not kv_caches[0].scales_pending):
            return runner(x, [(cos, sin)] if sliding is None else [(cos, sin), sliding], kv_caches, meta)
        delta = self._run_layers(x, delta, (cos, sin), sliding, kv_caches, meta)
        assert self.norm is not None, "a pipeline stage before the last runs forward_stage"
        hidden: torch.Tensor = self.norm(x, delta)
        return hidden

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                      meta: AttentionMetadata, received: StageActivations | None) -> StageActivations:
        """A pipeline stage before the last: its layers over the embedded tokens (the first stage) or over what the
        stage before handed on; returns what the next stage continues from."""
        x, delta, cos, sin, sliding = self._stage_input(input_ids, positions, received)
        return StageActivations(x, self._run_layers(x, delta, (cos, sin), sliding, kv_caches, meta))

    def _stage_input(self, input_ids: torch.Tensor, positions: torch.Tensor, received: StageActivations | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, RopeTables | None]:
        """The residual stream the layers start from, the sublayer output still to add to it, and rope's tables (the
        sliding layers' own, where the model has them: Gemma 3)."""
        if received is None:
            assert self.embed_tokens is not None, "a pipeline stage after the first continues from the one before"
            x: torch.Tensor = self.embed_tokens(input_ids)
            if self.config.embedding_multiplier is not None:  # as HF: the multiplier in the model's dtype
                x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
            delta = None
        else:
            x, delta = received.residual, received.delta
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        sliding = None if self.sliding_rotary is None else self.sliding_rotary.cos_sin(positions, x.dtype)
        return x, delta, cos, sin, sliding

    def _run_layers(self, x: torch.Tensor, delta: torch.Tensor | None, rope: RopeTables, sliding: RopeTables | None,
                    kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = sliding if sliding is not None and layer.sliding_rope else rope
            delta = layer(x, delta, cos, sin, kv_cache, meta.for_layer(index), self.backend)
        assert delta is not None, "a model or stage has at least one layer"
        return delta

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: split across ranks, each rank's columns are gathered."""
        assert self.lm_head is not None, "only the last pipeline stage holds the LM head"
        logits: torch.Tensor = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.gather_columns(logits)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2, in the model's dtype as HF
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # --- weights -----------------------------------------------------------------------------------

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str | torch.device
    ) -> None:
        """Copies HF-named tensors in, fusing q/k/v and gate/up. Fails naming any missing tensor."""
        self.to(dtype=dtype).to_empty(device=device)
        with torch.no_grad():
            # First touch places the pages. Touched here, in forward order and before the checkpoint is
            # read (not in the file's order, q/k/v and gate/up each in parts), bench-1b's weights streamed
            # 1-2% faster through the fp32 GEMV on a fast host.
            for param in self.parameters():
                param.zero_()
        self.rotary.recompute(device)
        if self.sliding_rotary is not None:
            self.sliding_rotary.recompute(device)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, offset = target
            param = params[name]
            with torch.no_grad():
                rows = slice(offset, offset + tensor.shape[0]) if offset is not None else slice(None)
                if param[rows].shape != tensor.shape:
                    raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                     f"{tuple(param[rows].shape)}")
                param[rows].copy_(tensor)
            loaded.add(f"{name}@{offset}")
        if self.config.tie_word_embeddings:
            assert self.lm_head is not None and self.embed_tokens is not None
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight@None")
        missing = sorted(set(self._expected_keys()) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        split_grouped_experts(self)

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        """Maps an HF tensor name to (our parameter, row offset inside a fused parameter)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        if self.expert_rows and (expert := expert_target(name, self.expert_rows)) is not None:
            return expert
        match = re.fullmatch(r"layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)", name)
        if match:
            layer, module, which, kind = match.groups()
            fused = "qkv_proj" if module == "self_attn" else "gate_up_proj"
            return f"layers.{layer}.{module}.{fused}.{kind}", self.fused_rows[fused][which]
        if name not in dict(self.named_parameters()):
            raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
        return name, None

    def _expected_keys(self) -> list[str]:
        keys = []
        for name, _ in self.named_parameters(remove_duplicate=False):
            # A parameter's name ends in <module>.<weight|bias>; a grouped expert tensor's offsets are its own.
            offsets = self.expert_rows.get(name) or self.fused_rows.get(name.split(".")[-2])
            keys += [f"{name}@{offset}" for offset in offsets.values()] if offsets else [f"{name}@None"]
        return keys
