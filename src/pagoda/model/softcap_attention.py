"""Attention with soft-capped scores (Gemma 2): each score q·k·scale becomes cap · tanh(score / cap) before the
mask and the softmax.

Torch's SDPA and pagoda's prefill kernels take no cap, so prefills here are HF's eager attention over the
sequence's gathered keys. Decodes run the paged decode kernel, which caps scores itself (and so does the native
decode stack, which then serves such a model's decode steps), or without kernels the reference's two batched
matmuls. `backends.create_runtime` picks a backend from here for a model whose config has
`attn_logit_softcapping`.
"""

from __future__ import annotations

import torch

from pagoda.model.attention import AttentionMetadata, CpuAttentionBackend, PrefillSeq, TorchAttentionBackend
from pagoda.model.kernel_protocols import CpuKernels
from pagoda.model.kv_cache import LayerKV


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap


def capped_prefill(q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                   out: torch.Tensor, softcap: float) -> None:
    group = q.shape[1] // kv.num_kv_heads
    keys, values = kv.gather(seq.key_slots, q.dtype)  # [L, kv_heads, D]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, D]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = _capped(torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale, softcap)  # [heads, q_len, L]
    scores = scores.masked_fill(~seq.mask(window), float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    out.copy_(torch.matmul(weights, values).transpose(0, 1))


class SoftCappedAttentionBackend(TorchAttentionBackend):
    """The torch reference's soft-capped attention."""

    def __init__(self, softcap: float) -> None:
        self.softcap = softcap

    def decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv.num_kv_heads
        keys, values = kv.gather(meta.decode_key_slots, torch.float32)  # [B, L, kv_heads, D]
        query = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = _capped(torch.matmul(query, keys.permute(0, 2, 3, 1)) * scale, self.softcap)  # [B, kvh, group, L]
        scores = scores.masked_fill(~meta.decode_masks[window], float("-inf"))
        attended = torch.matmul(scores.softmax(dim=-1), values.transpose(1, 2))  # [B, kv_heads, group, D]
        return attended.view(batch, num_heads, head_dim).to(q.dtype)

    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        capped_prefill(q, kv, seq, scale, window, out, self.softcap)


class SoftCappedCpuAttentionBackend(CpuAttentionBackend):
    """pagoda's kernels with capped scores: the paged decode kernel caps them (`CpuAttentionBackend.softcap`);
    prefills are the reference's."""

    def __init__(self, kernels: CpuKernels, softcap: float, decode_stack: bool = False) -> None:
        super().__init__(kernels, decode_stack)
        self.softcap = softcap

    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        capped_prefill(q, kv, seq, scale, window, out, self.softcap)
