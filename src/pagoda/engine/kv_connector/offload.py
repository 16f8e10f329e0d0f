"""The OffloadingConnector's scheduler side (torch-free): which blocks the tiers can supply past the local prefix
hit, and each step's metadata, the loads and saves the worker side (offload_worker.py) carries out.

Write-through: every block that a step fills with computed KV is saved to every tier after that step's forward, so
a block the device pool later evicts is still a tier below. A prefix-cache miss asks the tiers, the local one first,
then the shared one for the blocks after what the local one holds. The lookup only says a tier holds a key; the
load reads and checks the value, and a value that is gone, corrupt or of another layout fails the load from there
on (those tokens are computed instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.engine.core.kv_connector import StepItem
from pagoda.engine.core.request import Request
from pagoda.engine.kv_connector.keys import block_keys
from pagoda.engine.kv_connector.stores import KVStore

BlockHashes = Callable[[Request, int], list[bytes]]  # a request's chained block hashes, the first n


@dataclass(frozen=True)
class BlockLoad:
    key: bytes
    block_id: int


@dataclass(frozen=True)
class RequestLoad:
    request_id: str
    first_token: int  # the position of the first loaded token (the local hit's end)
    blocks: tuple[BlockLoad, ...]


@dataclass(frozen=True)
class BlockSave:
    request_id: str
    key: bytes
    block_id: int
    parent_hash: bytes | None  # the block before it (for its KV event)
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class OffloadMetadata:
    loads: tuple[RequestLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()


@dataclass
class _Lookup:
    first_block: int
    keys: list[bytes]
    num_found: int


class OffloadingScheduler:
    """`loads`/`saves`: the connector's role (kv_consumer only loads, kv_producer only saves)."""

    def __init__(self, tiers: Sequence[KVStore], namespace: bytes, block_size: int, block_hashes: BlockHashes,
                 loads: bool = True, saves: bool = True) -> None:
        self.tiers = list(tiers)
        self.namespace = namespace
        self.block_size = block_size
        self.block_hashes = block_hashes
        self.loads = loads
        self.saves = saves
        self._lookups: dict[str, _Lookup] = {}
        self._pending: dict[str, RequestLoad] = {}  # admitted this step, loading before its forward
        # per request: its blocks below this are in the tiers, or are being saved or loaded there
        self._saved_upto: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self._lookups.pop(request.request_id, None)
        if not self.loads or request.needs_prompt_logprobs:
            return 0
        size = self.block_size
        first, last = num_computed_tokens // size, (request.num_tokens - 1) // size
        if first >= last:
            return 0
        keys = block_keys(self.namespace, self.block_hashes(request, last)[first:last])
        found = 0
        for tier in self.tiers:
            found += tier.contains(keys[found:])
            if found == len(keys):
                break
        if found:
            self._lookups[request.request_id] = _Lookup(first, keys, found)
        return found * size

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        self._saved_upto[request.request_id] = request.num_computed_tokens // self.block_size
        if num_external_tokens == 0 or lookup is None:
            return
        num_blocks = num_external_tokens // self.block_size
        assert num_blocks <= lookup.num_found, "more external tokens than the lookup found"
        blocks = tuple(BlockLoad(lookup.keys[index], block_ids[lookup.first_block + index])
                       for index in range(num_blocks))
        self._pending[request.request_id] = RequestLoad(request.request_id, lookup.first_block * self.block_size,
                                                        blocks)

    def build_connector_meta(self, items: Sequence[StepItem]) -> OffloadMetadata:
        pending, self._pending = self._pending, {}  # a load admitted and then preempted in this step is dropped
        loads, saves = [], []
        for item in items:
            request = item.request
            load = pending.get(request.request_id)
            if load is not None:
                loads.append(load)
            if self.saves:
                saves += self._saves(request, (request.num_computed_tokens + item.num_known_tokens) // self.block_size)
        return OffloadMetadata(tuple(loads), tuple(saves))

    def _saves(self, request: Request, num_full: int) -> list[BlockSave]:
        """The blocks this step fills (full of computed, known tokens once its forward ran), not saved yet."""
        first = self._saved_upto.get(request.request_id, num_full)
        if num_full <= first:
            return []
        self._saved_upto[request.request_id] = num_full
        hashes = self.block_hashes(request, num_full)
        size = self.block_size
        return [
            BlockSave(request.request_id, self.namespace + hashes[index], request.block_ids[index],
                      hashes[index - 1] if index else None,
                      tuple(request.all_token_ids[index * size : (index + 1) * size]))
            for index in range(first, num_full)
        ]

    def load_failed(self, request: Request, num_valid_tokens: int) -> None:
        # The request did not run: its saves of this step were dropped with it.
        upto = self._saved_upto.get(request.request_id, 0)
        self._saved_upto[request.request_id] = min(upto, num_valid_tokens // self.block_size)

    def request_finished(self, request: Request) -> int:
        for state in (self._lookups, self._pending, self._saved_upto):
            state.pop(request.request_id, None)
        return 0

    def finished_sending(self) -> list[str]:
        return []
