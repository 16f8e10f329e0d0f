"""The engine's LoRA adapters: names resolved to loaded weights, kept in memory, and placed in the model's slots.

`resolve` runs at submission: it reads and checks the adapter (a bad one is refused before it is queued), and
gives the request its `AdapterId`. A name stays the same AdapterId while its directory is unchanged (its path,
and its two files' size and modification time); other weights under the same name are a new generation, whose
KV blocks never mix with the old one's. Up to `max_cpu_loras` adapters stay loaded, the least recently used
dropped beyond (and read again from their directory if a request still needs them). `begin_step` runs before
each forward: the step's adapters (at most max_loras: the scheduler's bound) are put in the model's slots,
reusing a slot that already holds one, else an empty one, else the least recently used, and every row is told
its slot. Under tensor parallelism every rank has slots of its own (`AdapterSlots`): rank 0's manager makes each
call on its own and sends it, as an `AdapterSlotsCall` down the workers' pipes before the step, to theirs.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pagoda.config import LoRAConfig, ModelConfig
from pagoda.engine.core.lora import AdapterId, distinct_adapters
from pagoda.engine.core.scheduler import ScheduledRequest
from pagoda.lora_request import LoRARequest
from pagoda.model.lora_checkpoint import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, LoRALoadError, load_lora_adapter

Fingerprint = tuple[tuple[int, int, int], ...]


def _fingerprint(path: str) -> Fingerprint:
    """What says the adapter's files are the ones read before: each file's inode, size and modification time."""
    stamps = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            stat = os.stat(Path(path) / name)
        except OSError:
            stamps.append((0, -1, 0))
            continue
        stamps.append((stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


class AdapterSlots(Protocol):
    """Where adapters are placed for a forward: a model's `LoRAStack`, or rank 0's and the other ranks' together."""

    def load(self, slot: int, adapter: LoRAAdapter) -> None: ...

    def begin_step(self, token_slots: Sequence[int] | None) -> None: ...


@dataclass(frozen=True)
class AdapterSlotsCall:
    """A call rank 0 made on its adapter slots, for a worker rank to make on its own (in order with the steps)."""

    method: str  # "load" (args: slot, adapter) or "begin_step" (args: the rows' slots or None)
    args: tuple[object, ...]

    def apply(self, slots: AdapterSlots) -> None:
        getattr(slots, self.method)(*self.args)


@dataclass(frozen=True)
class _Source:
    path: str
    fingerprint: Fingerprint


class LoRAManager:
    def __init__(self, config: LoRAConfig, stack: AdapterSlots, model_config: ModelConfig) -> None:
        """stack: where the step's adapters go; model_config: the whole model's (adapters are checked against it)."""
        self.config = config
        self.stack = stack
        self.model_config = model_config
        self._current: dict[str, AdapterId] = {}  # each name's latest generation
        self._sources: dict[AdapterId, _Source] = {}
        self._loaded: OrderedDict[AdapterId, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slots: list[AdapterId | None] = [None] * config.max_loras
        self._slot_order: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(config.max_loras))

    @property
    def max_loras(self) -> int:
        return self.config.max_loras

    def resolve(self, request: LoRARequest) -> AdapterId:
        """The request's adapter, loaded and checked (LoRALoadError names what is wrong)."""
        path = request.lora_path
        fingerprint = _fingerprint(path)
        current = self._current.get(request.lora_name)
        if current is not None and self._sources[current] == _Source(path, fingerprint):
            self._weights(current)
            return current
        adapter = load_lora_adapter(path, self.model_config, self.config.max_lora_rank)
        adapter_id = AdapterId(request.lora_name, 0 if current is None else current.generation + 1)
        self._current[request.lora_name] = adapter_id
        self._sources[adapter_id] = _Source(path, fingerprint)
        self._keep(adapter_id, adapter)
        return adapter_id

    def forget(self, name: str, in_use: Sequence[AdapterId]) -> None:
        """Drops the weights of the name's generations that no request in `in_use` holds. Its generation count
        stays: loaded again with other weights, the name is a new generation, whose blocks never mix with these."""
        for adapter_id in [a for a in self._loaded if a.name == name and a not in in_use]:
            del self._loaded[adapter_id]

    def loaded(self) -> list[AdapterId]:
        """The adapters in memory, least recently used first."""
        return list(self._loaded)

    def begin_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Puts the step's adapters in slots and tells the model which slot each row of the flat batch uses."""
        adapters = distinct_adapters(item.request.lora for item in scheduled)
        if not adapters:
            self.stack.begin_step(None)
            return
        slot_of = self._place(adapters)
        rows: list[int] = []
        for item in scheduled:
            adapter = item.request.lora
            rows += [-1 if adapter is None else slot_of[adapter]] * item.num_tokens
        self.stack.begin_step(rows)

    def _place(self, adapters: list[AdapterId]) -> dict[AdapterId, int]:
        if len(adapters) > self.config.max_loras:  # the scheduler bounds a step's adapters: a broken invariant
            raise RuntimeError(f"a step holds {len(adapters)} adapters, more than max_loras {self.config.max_loras}")
        slot_of = {adapter: slot for slot, adapter in enumerate(self._slots) if adapter in adapters}
        for adapter in adapters:
            if adapter not in slot_of:
                # An empty slot first (they come first in the order), else the least recently used one not needed now.
                slot = next(slot for slot in self._slot_order if self._slots[slot] not in slot_of)
                self.stack.load(slot, self._weights(adapter))
                self._slots[slot] = adapter
                slot_of[adapter] = slot
            self._slot_order.move_to_end(slot_of[adapter])
        return slot_of

    def _weights(self, adapter_id: AdapterId) -> LoRAAdapter:
        adapter = self._loaded.get(adapter_id)
        if adapter is not None:
            self._loaded.move_to_end(adapter_id)
            return adapter
        source = self._sources[adapter_id]
        if _fingerprint(source.path) != source.fingerprint:
            raise LoRALoadError(f"LoRA adapter {adapter_id.name!r}: {source.path!r} changed on disk while requests "
                                "on its earlier weights were still waiting, and those weights are no longer loaded "
                                "(raise --max-cpu-loras)")
        adapter = load_lora_adapter(source.path, self.model_config, self.config.max_lora_rank)
        self._keep(adapter_id, adapter)
        return adapter

    def _keep(self, adapter_id: AdapterId, adapter: LoRAAdapter) -> None:
        self._loaded[adapter_id] = adapter
        self._loaded.move_to_end(adapter_id)
        while len(self._loaded) > self.config.cpu_capacity:
            self._loaded.popitem(last=False)
