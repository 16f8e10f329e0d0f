"""The TcpConnector's scheduler side (prefill/decode disaggregation, docs/disaggregation.md). Torch-free.

Producer (kv_producer, kv_both): a request sent with `kv_transfer_params.do_remote_decode` keeps its prompt's
full blocks when it finishes (all but the block of the last prompt token, which a decode replica computes to
sample from); `request_finished` records them in `HeldBlocks` and answers the request's kv_transfer_params (where
to pull them from). The block server (transfer_worker.py) serves them to one pull; they go back to the pool once
copied out, or after `hold_timeout_s`, whichever comes first, and stay in the prefix cache.

Consumer (kv_consumer, kv_both): a pull lands the blocks in a receive buffer (a LocalStore keyed like the
offload tiers, by the prefix cache's block hashes under the model's namespace) before the request reaches the
scheduler, so admitting it finds them there exactly as the OffloadingConnector finds a local tier's blocks:
the existing lookup and load path, which this delegates to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagoda.engine.core.kv_connector import StepItem
from pagoda.engine.core.request import FinishReason, Request
from pagoda.engine.kv_connector.offload import BlockHashes, OffloadingScheduler, OffloadMetadata
from pagoda.kv_transfer_params import KVTransferParams


@dataclass
class _Held:
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    deadline: float
    serving: bool = False  # a pull is copying them out: not released by the timeout meanwhile


class HeldBlocks:
    """The blocks finished requests hold for a pull, shared by the engine thread (adds, releases) and the block
    server's threads (serves). A held block is never written (its request is gone and its ref count keeps it out
    of the free queue), so a server thread may read it while the engine steps; it is released only when no pull
    is reading it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: list[str] = []  # served (or refused mid-way): to go back to the pool at the next poll

    def add(self, request_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], timeout_s: float) -> None:
        with self._lock:
            self._held[request_id] = _Held(tuple(block_ids), tuple(block_hashes), self.clock() + timeout_s)

    def begin_serving(self, request_id: str, block_ids: Sequence[int]) -> list[tuple[int, bytes]] | str:
        """The (block id, block hash) pairs a pull of `block_ids` reads, or why it may not (unknown or released
        request, ids that are not a prefix of what it holds)."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.serving:
                return f"no blocks are held for request {request_id!r} (pulled already, or held past the timeout)"
            if tuple(block_ids) != held.block_ids[: len(block_ids)]:
                return f"blocks {list(block_ids)[:8]} are not what request {request_id!r} holds"
            held.serving = True
            return list(zip(held.block_ids, held.block_hashes))[: len(block_ids)]

    def finish_serving(self, request_id: str) -> None:
        """The pull has copied its blocks out (or failed): they may go back to the pool."""
        with self._lock:
            if self._held.pop(request_id, None) is not None:
                self._released.append(request_id)

    def take_released(self) -> list[str]:
        """Requests whose blocks may go back to the pool: served, or held past their deadline unread."""
        now = self.clock()
        with self._lock:
            released, self._released = self._released, []
            for request_id, held in list(self._held.items()):
                if not held.serving and held.deadline <= now:
                    del self._held[request_id]
                    released.append(request_id)
            return released

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(held.block_ids) for held in self._held.values())


@dataclass(frozen=True)
class Endpoint:
    """What a prefill replica's kv_transfer_params say about it."""

    engine_id: str
    host: str
    port: int


class TransferScheduler:
    """`receiving`: the consumer's lookup and loads over the receive buffer (None: this engine only produces).
    `held`, `endpoint`: the producer's (None: this engine only consumes)."""

    def __init__(self, block_size: int, block_hashes: BlockHashes, receiving: OffloadingScheduler | None,
                 held: HeldBlocks | None, endpoint: Callable[[], Endpoint] | None, hold_timeout_s: float) -> None:
        self.block_size = block_size
        self.block_hashes = block_hashes
        self.receiving = receiving
        self.held = held
        self.endpoint = endpoint  # asked when a request finishes: the block server's port is known once it listens
        self.hold_timeout_s = hold_timeout_s

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.receiving is None:
            return 0
        return self.receiving.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        if self.receiving is not None:
            self.receiving.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, items: Sequence[StepItem]) -> OffloadMetadata:
        return OffloadMetadata() if self.receiving is None else self.receiving.build_connector_meta(items)

    def load_failed(self, request: Request, num_valid_tokens: int) -> None:
        if self.receiving is not None:
            self.receiving.load_failed(request, num_valid_tokens)

    def request_finished(self, request: Request) -> int:
        if self.receiving is not None:
            self.receiving.request_finished(request)
        params = request.params.kv_transfer_params
        if self.held is None or self.endpoint is None or params is None or not params.do_remote_decode \
                or request.sample_index != 0 or request.finish_reason == FinishReason.ABORT:
            return 0
        size = self.block_size
        # Whole blocks of computed prompt tokens, never the last prompt token's: the decode side computes that one.
        num_blocks = min((request.num_prompt_tokens - 1) // size, request.num_computed_tokens // size,
                         len(request.block_ids))
        block_ids = request.block_ids[:num_blocks]
        endpoint = self.endpoint()
        request.kv_transfer_params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=endpoint.engine_id, remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids), remote_host=endpoint.host, remote_port=endpoint.port)
        if num_blocks:
            self.held.add(request.request_id, block_ids, self.block_hashes(request, num_blocks), self.hold_timeout_s)
        return num_blocks

    def finished_sending(self) -> list[str]:
        return [] if self.held is None else self.held.take_released()
