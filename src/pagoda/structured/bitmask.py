"""Token bitmasks: int32 [batch, ceil(vocab / 32)], bit (t % 32) of word (t // 32) set when token t is allowed.

Plain torch ops, no torch.compile: compiling costs tens of seconds on a cold start. The mask reaches the
logits as an additive bias (0 where allowed, -inf where not) gathered byte by byte from a 256-entry table:
on CPU that is ~10x faster than unpacking bits and calling masked_fill_ (which does not vectorize).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row for `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(batch_size: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask with every token allowed. Pinned memory makes its copy to an accelerator asynchronous."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit still lands in bit 0
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] != 0


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set the logits of disallowed tokens to -inf, in place, in the constrained rows only.

    logits: float [batch, vocab], on any device, finite or -inf (a +inf logit at a disallowed token would
    become NaN). bitmask: int32 [>= batch, words] on the CPU (pinned for a non-blocking copy) or on logits'
    device; its row i holds the mask of logits' row i. rows: the indices of the constrained rows; None
    means every row. Allowed logits keep their value; other rows are not touched.
    """
    batch, vocab_size = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} with shape {tuple(bitmask.shape)}")
    if bitmask.shape[1] * BITS_PER_WORD < vocab_size:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * BITS_PER_WORD} tokens, logits have {vocab_size}")
    if rows is None:
        if bitmask.shape[0] < batch:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits have {batch}")
        logits.add_(_bias(bitmask[:batch], logits, vocab_size))
        return
    row_index = torch.as_tensor(rows, dtype=torch.long)
    if row_index.numel() == 0:
        return
    # Select on the mask's device first, so that only the constrained rows travel.
    words = bitmask.index_select(0, row_index.to(bitmask.device))
    logits.index_add_(0, row_index.to(logits.device), _bias(words, logits, vocab_size))


def _bias(words: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] in logits' dtype and device: 0 where the token is allowed, -inf where it is not."""
    words = words.to(logits.device, non_blocking=True).contiguous()
    # Little-endian (every platform torch runs on): byte k of a row holds the bits of tokens 8k .. 8k+7.
    row_bytes = words.view(torch.uint8).reshape(-1).to(torch.int32)
    bias = _bias_table(logits.device, logits.dtype).index_select(0, row_bytes)
    return bias.reshape(words.shape[0], -1)[:, :vocab_size]


_BIAS_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _bias_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry (b, j) is 0 when bit j of byte b is set, else -inf. Built once per device and dtype."""
    table = _BIAS_TABLES.get((device, dtype))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
        _BIAS_TABLES[(device, dtype)] = table  # a race only builds an identical table twice
    return table
