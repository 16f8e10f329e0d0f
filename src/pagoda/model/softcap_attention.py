"""Attention with soft-capped scores (Gemma 2): each score q·k·scale becomes cap · tanh(score / cap) before the
mask and the softmax.

Neither torch's SDPA nor pagoda's paged kernels take a cap, so this backend is the reference's gather-and-matmul
in both phases: decodes as the reference's two batched matmuls, prefills as HF's eager attention over the
sequence's gathered keys. `backends.create_runtime` picks it for a model whose config has
`attn_logit_softcapping`; such a model runs no native decode stack.
"""

from __future__ import annotations

import torch

from pagoda.model.attention import AttentionMetadata, PrefillSeq, TorchAttentionBackend
from pagoda.model.kv_cache import LayerKV


class SoftCappedAttentionBackend(TorchAttentionBackend):
    def __init__(self, softcap: float) -> None:
        self.softcap = softcap

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.tanh(scores / self.softcap) * self.softcap

    def decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv.num_kv_heads
        keys, values = kv.gather(meta.decode_key_slots, torch.float32)  # [B, L, kv_heads, D]
        query = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = self._capped(torch.matmul(query, keys.permute(0, 2, 3, 1)) * scale)  # [B, kv_heads, group, L]
        scores = scores.masked_fill(~meta.decode_masks[window], float("-inf"))
        attended = torch.matmul(scores.softmax(dim=-1), values.transpose(1, 2))  # [B, kv_heads, group, D]
        return attended.view(batch, num_heads, head_dim).to(q.dtype)

    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        group = q.shape[1] // kv.num_kv_heads
        keys, values = kv.gather(seq.key_slots, q.dtype)  # [L, kv_heads, D]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = self._capped(torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale)  # [heads, q_len, L]
        scores = scores.masked_fill(~seq.mask(window), float("-inf"))
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out.copy_(torch.matmul(weights, values).transpose(0, 1))
