"""Adapters as the scheduler and the KV cache see them: an identity, and the bound on adapters per step.

Pure Python; no torch. The engine's adapter registry (engine/lora_manager.py) gives each loaded adapter its
`AdapterId`; a Request carries it from submission to the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterId:
    """An adapter as loaded: its name, and how many times that name has been loaded with other weights before.
    Two requests share KV blocks only under the same AdapterId, so a name reloaded with new weights never
    serves blocks its old weights computed."""

    name: str
    generation: int

    @property
    def key(self) -> str:
        """What the block hash chains (block_hash.hash_block's `adapter`): the generation first, so that the
        first colon ends it whatever the name holds."""
        return f"{self.generation}:{self.name}"


def distinct_adapters(adapters: Iterable[AdapterId | None]) -> list[AdapterId]:
    """The distinct adapters among these (None: the base model), in first-seen order."""
    return list(dict.fromkeys(adapter for adapter in adapters if adapter is not None))


def adapter_fits(adapter: AdapterId | None, running: Iterable[AdapterId | None], max_loras: int | None) -> bool:
    """May a request on `adapter` run beside running requests on `running` without the batch holding more than
    max_loras adapters? The running requests' adapters stay pinned: a new adapter waits until one of theirs has
    no running request left."""
    if adapter is None or max_loras is None:
        return True
    active = distinct_adapters(running)
    return adapter in active or len(active) < max_loras
