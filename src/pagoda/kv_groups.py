"""How a model's layers share the KV pool: its KV cache groups (vLLM v1's hybrid KV cache layout).

Layers are grouped by the keys they attend to: full attention (every earlier position) or a sliding window of W
positions. A group's layers take the same blocks for a request, from one pool; a sliding group frees the blocks
that fell wholly out of its window while the full groups keep everything. Every group has the same number of
layers (the gcd of the kinds' layer counts), so a block is the same bytes whoever holds it: the pool's tensor
number i holds layer i of every group, and a block id is a slice of each of those tensors, used by the one group
that holds it. A window at least as long as the context excludes nothing: such layers count as full.

Pure Python (the KV manager, the model's cache and the calculator all read it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # model layer indices, in order


def kv_cache_groups(sliding_windows: Sequence[int | None], num_layers: int,
                    max_model_len: int) -> tuple[KVCacheGroup, ...]:
    """The model's groups, full ones first, then sliding ones by window. One kind of layer: one group of all
    layers (a model without windows: today's single-table layout)."""
    windows = list(sliding_windows) or [None] * num_layers
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(None if window is None or window >= max_model_len else window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = []
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):
        layers = kinds[window]
        groups += [KVCacheGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return tuple(groups)


def is_hybrid(groups: Sequence[KVCacheGroup]) -> bool:
    """Whether the layout differs from one block table over every layer: several groups, or a sliding one."""
    return len(groups) > 1 or groups[0].window is not None


def layer_tensor_index(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """For each layer, which of the pool's per-layer tensors holds its KV: its place within its group."""
    index = [0] * num_layers
    for group in groups:
        for place, layer in enumerate(group.layers):
            index[layer] = place
    return index


def window_blocks(window: int, block_size: int, chunk: int = 1) -> int:
    """The most blocks a sliding group holds for one request that computes `chunk` tokens a step: its window's
    keys before the chunk (W - 1 positions, which may straddle one more block than they fill) and the chunk."""
    return -(-(window - 1 + chunk) // block_size) + 1


def blocks_per_sequence(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk: int = 1) -> int:
    """Blocks one sequence of `num_tokens` tokens holds at most, over all groups, computing `chunk` tokens a
    step (a prefill chunk needs its own keys and the window before it)."""
    full = -(-num_tokens // block_size)
    return sum(full if group.window is None else min(full, window_blocks(group.window, block_size, chunk))
               for group in groups)


def kv_tokens_per_layer(sliding_windows: Sequence[int | None], num_tokens: float) -> float:
    """The KV one sequence of `num_tokens` tokens keeps, in tokens per layer averaged over the layers: a sliding
    layer its window (the rest returns to the pool), a full one every token. Token-level: the engine's blocks
    round each group up to whole blocks (`blocks_per_sequence`)."""
    if not sliding_windows:
        return float(num_tokens)
    kept = sum(num_tokens if window is None else min(num_tokens, window) for window in sliding_windows)
    return kept / len(sliding_windows)
