"""Paged attention: one interface, a backend per device.

The KV cache of a layer is a `LayerKV` (model/kv_cache.py): K and V [num_slots, num_kv_heads, head_dim]
(num_slots = blocks x block_size), in the model's dtype or quantized, with their scales. Each step,
`rotate_and_write_kv` applies rope to the new tokens' q and k and stores their K/V at their slots (quantized
as they are written), and `forward` attends each
sequence's queries to the keys its block table points at. Everything shape-dependent (gather indices,
masks) is built once per step in `build_metadata`, outside the layers (a prefill's mask at the first
layer that needs one): no hidden global context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from pagoda.model.kv_cache import LayerKV
from pagoda.model.layers import apply_rotary

if TYPE_CHECKING:
    from pagoda.model.kernel_protocols import CpuKernels


@dataclass
class PrefillSeq:
    """A sequence computing more than one token this step (a prompt chunk or a recompute)."""

    query_start: int
    query_end: int
    key_slots: torch.Tensor  # [seq_len] cache slots of all its keys, in position order
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor:
        """[q_len, seq_len] bool, True = attend; built at the first layer that asks, once a step. Not
        before: the kernels take positions instead, and a long prompt's mask is large (a 2,048-token
        chunk of a 32K-token prompt: 64 MB a window)."""
        if window not in self._masks:
            seq_len = self.key_slots.numel()
            key_pos = torch.arange(seq_len)
            query_pos = key_pos[seq_len - (self.query_end - self.query_start) :, None]
            self._masks[window] = _window_mask(query_pos, key_pos[None], window)
        return self._masks[window]


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] absolute position of each token of the flat batch
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    # Decodes (one query token each) are batched: keys gathered into [num_decodes, max_seq_len].
    decode_token_index: torch.Tensor  # [num_decodes] their rows in the flat batch
    # [num_decodes, max_seq_len]; a shorter sequence's padding repeats its first key's slot (written, masked):
    # the pool is not zero-filled, and an unwritten slot's NaN would survive a zero attention weight.
    decode_key_slots: torch.Tensor
    decode_seq_lens: torch.Tensor  # [num_decodes]
    decode_masks: dict[int | None, torch.Tensor]  # per window: [num_decodes, 1, 1, max_seq_len]
    prefills: list[PrefillSeq] = field(default_factory=list)
    # With several KV cache groups (pagoda/kv_groups.py): each group's metadata (this one first), whose slots go
    # through that group's block tables (positions are the same in all), and each layer's group. Empty: every
    # layer takes this one.
    group_metas: list[AttentionMetadata] = field(default_factory=list)
    layer_groups: Sequence[int] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.group_metas[self.layer_groups[layer]] if self.layer_groups else self

    @property
    def num_decodes(self) -> int:
        return self.decode_token_index.numel()


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    mask = key_pos <= query_pos
    if window is not None:
        mask &= query_pos - key_pos < window
    return mask


def slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's position through its block table (build_metadata does all at once)."""
    return block_ids[position // block_size] * block_size + position % block_size


@dataclass
class QueryLayout:
    """A step's attention queries in flat-batch order, as `build_metadata` takes them: each query's length,
    its sequence length (its tokens included), its sequence's block table (KV cache group 0's; the other
    groups' in `group_tables`), and the branch slots."""

    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    branch_slots: dict[int, int] = field(default_factory=dict)
    group_tables: list[list[list[int]]] = field(default_factory=list)  # [group - 1][query]: groups 1.. tables

    def add(self, start: int, lengths: list[int], block_ids: list[int],
            other_groups: Sequence[list[int]] = ()) -> int:
        """A sequence's consecutive queries of these lengths, the first at position `start`; returns the
        position after the last. other_groups: the sequence's tables in KV cache groups 1.. (if several)."""
        self.group_tables.extend([] for _ in range(len(other_groups) - len(self.group_tables)))
        for length in lengths:
            start += length
            self.query_lens.append(length)
            self.seq_lens.append(start)
            self.block_tables.append(block_ids)
            for tables, table in zip(self.group_tables, other_groups):
                tables.append(table)
        return start

    def add_branch(self, position: int, slot: int, block_ids: list[int]) -> None:
        """A one-token query at `position` whose token's K/V is at `slot` (build_metadata's branch_slots)."""
        assert not self.group_tables, "speculative branches are not laid out over several KV cache groups"
        self.branch_slots[len(self.query_lens)] = slot
        self.add(position, [1], block_ids)

    def split(self, parts: int, min_tokens: int = 1) -> list[tuple[QueryLayout, slice]]:
        """The step's tokens cut into at most `parts` runs of consecutive tokens as even as tokens go (fewer where
        runs of `min_tokens` would not fill them), each with its tokens' slice of the flat batch, in the step's
        order. A query cut between two runs becomes two queries of its sequence, as chunked prefill would have
        made them: running the runs one after another runs the step, since a query attends only to keys at
        positions before its own, written by an earlier run, a step before, or itself."""
        total = sum(self.query_lens)
        parts = min(parts, total // max(1, min_tokens))
        if parts <= 1:
            return [(self, slice(0, total))]
        ends = [total * part // parts for part in range(1, parts + 1)]
        runs: list[tuple[QueryLayout, slice]] = []
        run, start, done = QueryLayout(group_tables=[[] for _ in self.group_tables]), 0, 0
        for query, (length, seq_len) in enumerate(zip(self.query_lens, self.seq_lens)):
            offset = 0
            while offset < length:
                take = min(length - offset, ends[len(runs)] - done)
                if query in self.branch_slots:
                    run.branch_slots[len(run.query_lens)] = self.branch_slots[query]
                offset += take
                run.add(seq_len - length + offset - take, [take], self.block_tables[query],
                        [tables[query] for tables in self.group_tables])
                done += take
                if done == ends[len(runs)]:
                    runs.append((run, slice(start, done)))
                    run, start = QueryLayout(group_tables=[[] for _ in self.group_tables]), done
        return runs

    def metadata(self, block_size: int, windows: set[int | None], layer_groups: Sequence[int] = ()
                 ) -> AttentionMetadata:
        """layer_groups: each layer's KV cache group, where there are several (the metadata then holds each
        group's, and which each layer takes)."""
        meta = build_metadata(self.query_lens, self.seq_lens, self.block_tables, block_size, windows,
                              self.branch_slots)
        if not self.group_tables:
            return meta
        meta.group_metas = [meta] + [build_metadata(self.query_lens, self.seq_lens, tables, block_size, windows,
                                                    self.branch_slots) for tables in self.group_tables]
        meta.layer_groups = layer_groups
        return meta


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    windows: set[int | None],
    branch_slots: dict[int, int] | None = None,
) -> AttentionMetadata:
    """Flat-batch metadata for one step, in a fixed number of tensor ops (Python loops only over the
    step's prefills and branches). seq_lens include this step's tokens. branch_slots: query index -> the
    slot of a one-token query whose token is not at its position's slot in the block table (an alternative
    guess beside a chain of drafts at the same position): its K/V goes there, and it attends to the keys
    before its position and to that slot alone."""
    num_seqs, max_blocks = len(query_lens), max(len(table) for table in block_tables)
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
    query_lens_t, seq_lens_t = torch.tensor(query_lens), torch.tensor(seq_lens)
    key_pos = torch.arange(max(seq_lens))
    all_slots = table[:, key_pos // block_size] * block_size + key_pos % block_size  # [num_seqs, max_len]
    for query, slot in (branch_slots or {}).items():
        assert query_lens[query] == 1, "a branch is a one-token query"
        all_slots[query, seq_lens[query] - 1] = slot
    if bool((table < 0).any()):
        # A block a sliding window dropped (-1): its positions are out of every query's window, so masked; they
        # point at the sequence's newest slot, written this step, whose finite K/V a zero weight cancels.
        newest = all_slots[torch.arange(num_seqs), seq_lens_t - 1]
        all_slots = torch.where(all_slots < 0, newest[:, None], all_slots)

    query_starts = torch.cumsum(query_lens_t, 0) - query_lens_t
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
    first_new = (seq_lens_t - query_lens_t)[seq_of_token]
    positions = torch.arange(seq_of_token.numel()) - query_starts[seq_of_token] + first_new
    slot_mapping = all_slots[seq_of_token, positions]

    is_decode = query_lens_t == 1
    decode_seqs = is_decode.nonzero()[:, 0]
    decode_lens = seq_lens_t[decode_seqs]
    decode_width = int(decode_lens.max()) if decode_seqs.numel() else 0
    query_pos = decode_lens[:, None] - 1
    decode_masks = {w: _window_mask(query_pos, key_pos[None, :decode_width], w)[:, None, None, :] for w in windows}

    prefills = []
    for seq in (~is_decode).nonzero()[:, 0].tolist():
        start = int(query_starts[seq])
        prefills.append(PrefillSeq(start, start + query_lens[seq], all_slots[seq, : seq_lens[seq]]))
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping,
        decode_token_index=query_starts[decode_seqs],
        decode_key_slots=_written_slots_only(all_slots[decode_seqs, :decode_width], decode_lens),
        decode_seq_lens=decode_lens,
        decode_masks=decode_masks,
        prefills=prefills,
    )


def _written_slots_only(key_slots: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """key_slots [num_seqs, width] with each row's positions at or past its length pointed at its first slot."""
    padding = torch.arange(key_slots.shape[1])[None, :] >= seq_lens[:, None]
    return torch.where(padding, key_slots[:, :1], key_slots)


class DecodeRunner(Protocol):
    """Runs a model's whole layer stack for the decode-only steps it takes, in place of the modules."""

    def takes(self, meta: AttentionMetadata, num_tokens: int) -> bool: ...

    def __call__(self, x: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_caches: list[LayerKV], meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for the step's tokens; x (the embedded tokens) is updated in place. ropes: the
        step's (cos, sin), then the sliding layers' own where the model has them."""
        ...


class AttentionBackend(ABC):
    """How a model's layers attend over the paged KV cache; `backends.create_runtime` picks one per model.

    A backend implements rope + KV write, one batched decode and one prefill sequence; `forward` splits
    a step between them. It may also run whole decode steps (`decode_runner`, which
    `native_decode.bind_decode_stack` sets once the weights are final).
    """

    decode_runner: DecodeRunner | None = None

    @abstractmethod
    def rotate_and_write_kv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
        num_heads: int,
    ) -> torch.Tensor:
        """qkv: [num_tokens, heads + 2 kv_heads, head_dim]. Rotates q and k, stores k and v at the tokens'
        slots, and returns the rotated q [num_tokens, heads, head_dim]."""

    @abstractmethod
    def decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        """The step's decodes, one query [heads, D] each (q: [num_decodes, heads, D]), as one batch."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        """One sequence's queries [q_len, heads, D] attending to its keys, written into out."""

    def forward(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
                window: int | None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
        if not meta.prefills:  # a decode-only step: no scatter into a shared output
            return self.decode(q, kv, meta, scale, window)
        out = torch.empty_like(q)
        if meta.num_decodes:
            rows = meta.decode_token_index
            out[rows] = self.decode(q[rows], kv, meta, scale, window)
        for seq in meta.prefills:
            seq_rows = slice(seq.query_start, seq.query_end)
            self.prefill(q[seq_rows], kv, seq, scale, window, out[seq_rows])
        return out


def sdpa_prefill(q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                 out: torch.Tensor) -> None:
    """The reference prefill of one sequence: its keys gathered (dequantized, if quantized) and attended to with
    torch's SDPA."""
    group = q.shape[1] // kv.num_kv_heads
    query = q.transpose(0, 1)[None]  # [1, heads, q_len, D]
    keys, values = kv.gather(seq.key_slots, q.dtype)
    # Key/value heads repeated to the query heads: on CPU, SDPA's fused (flash) kernel takes only
    # 4-D inputs of equal head counts; `enable_gqa` falls back to the math path, 4x slower.
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    # A whole prompt under a plain causal mask needs no mask tensor (the kernel skips masked tiles).
    causal = window is None and query.shape[2] == keys.shape[2]
    attended = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=None if causal else seq.mask(window), is_causal=causal, scale=scale
    )
    out.copy_(attended[0].transpose(0, 1))


def torch_rotate_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV,
                              meta: AttentionMetadata, num_heads: int) -> torch.Tensor:
    """The reference rope + KV write: q and k rotated in one call (half the small ops), K/V stored (quantized)."""
    kv_heads = kv.num_kv_heads
    rotated = apply_rotary(qkv[:, : num_heads + kv_heads], cos, sin)
    kv.write(meta.slot_mapping, rotated[:, num_heads:], qkv[:, num_heads + kv_heads :])
    return rotated[:, :num_heads]


class TorchAttentionBackend(AttentionBackend):
    """The reference backend: gathers keys through the block tables and calls SDPA."""

    def rotate_and_write_kv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
        num_heads: int,
    ) -> torch.Tensor:
        return torch_rotate_and_write_kv(qkv, cos, sin, kv, meta, num_heads)

    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        sdpa_prefill(q, kv, seq, scale, window, out)

    def decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        """Two batched matmuls in fp32 over the gathered (and dequantized) keys.

        CPU SDPA spends most of its time on setup at this size (and is slow in bf16); plain matmuls
        over the gathered keys are several times faster and accumulate in fp32 whatever the model dtype.
        """
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv.num_kv_heads
        keys, values = kv.gather(meta.decode_key_slots, torch.float32)  # [B, L, kv_heads, D]
        query = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(query, keys.permute(0, 2, 3, 1)) * scale  # [B, kv_heads, group, L]
        scores = scores.masked_fill(~meta.decode_masks[window], float("-inf"))
        attended = torch.matmul(scores.softmax(dim=-1), values.transpose(1, 2))  # [B, kv_heads, group, D]
        return attended.view(batch, num_heads, head_dim).to(q.dtype)


class CpuAttentionBackend(AttentionBackend):
    """Attends through pagoda's paged-attention kernels, which read keys in place (nothing gathered or
    repeated to the query heads): decodes one query a sequence, in any KV format (int8 and fp8 codes
    dequantized in registers), prefills flash-attention style (bf16 on vdpbf16ps: torch's SDPA runs at a
    quarter of the bf16 GEMMs' rate without AMX; head dims that are not a multiple of 32, every prefill on the
    AVX2 target, and every prefill over a quantized cache, through the reference's SDPA on the sequence's
    dequantized keys). Rotates q/k and writes (quantizes) the cache in one kernel call. With `decode_stack`,
    `native_decode.bind_decode_stack` makes the native decode stack its decode runner, which runs decode-only
    steps whole."""

    # The scores' cap (0: none), which the decode kernel applies (model/softcap_attention.py's subclass sets it).
    softcap: float = 0.0

    def __init__(self, kernels: CpuKernels, decode_stack: bool = False) -> None:
        self.kernels = kernels
        self.decode_stack = decode_stack

    def rotate_and_write_kv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
        num_heads: int,
    ) -> torch.Tensor:
        if kv.scales_pending:  # fp8's scales come from this first write's rotated keys: the reference computes them
            return torch_rotate_and_write_kv(qkv, cos, sin, kv, meta, num_heads)
        self.kernels.rotary_write_kv_(qkv, cos, sin, kv.k, kv.v, meta.slot_mapping, num_heads, kv.k_scale,
                                      kv.v_scale)
        return qkv[:, :num_heads]

    def prefill(self, q: torch.Tensor, kv: LayerKV, seq: PrefillSeq, scale: float, window: int | None,
                out: torch.Tensor) -> None:
        # A head size, a target or a KV format without the kernel
        if q.shape[-1] % 32 or self.kernels.target != "avx512" or kv.format != "auto":
            sdpa_prefill(q, kv, seq, scale, window, out)
        else:
            self.kernels.paged_prefill_attention_(q, kv.k, kv.v, seq.key_slots, window or 0, scale, out)

    def decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
               window: int | None) -> torch.Tensor:
        return self.kernels.paged_decode_attention(q, kv.k, kv.v, meta.decode_key_slots, meta.decode_seq_lens,
                                                   window or 0, scale, kv.k_scale, kv.v_scale, self.softcap)
