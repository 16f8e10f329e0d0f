"""The KV connector's worker side, and a connector as the engine holds it (vLLM v1's KVConnectorBase_V1, worker
half). The scheduler side is engine/core/kv_connector.py's protocol. A connector touches tensors here only."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from pagoda.engine.api import KVTierStats
from pagoda.engine.core.kv_connector import KVConnectorScheduler
from pagoda.kv_transfer_params import KVTransferParams


class KVConnectorWorker(Protocol):
    def start_load_kv(self, metadata: object) -> dict[str, int]:
        """Loads the step's blocks into the KV pool before its forward, each within the connector's bounded wait.
        Returns, for each request whose load failed, how many of its tokens have valid KV (it does not run this
        step; the scheduler has it compute the rest)."""
        ...

    def save_kv(self, metadata: object, skip: Collection[str] = ()) -> None:
        """After the forward: hands the step's newly full blocks to be saved, without waiting for the store
        (`skip`: requests that did not run)."""
        ...

    def wait_for_saves(self, timeout_s: float = 10.0) -> None:
        """Returns once the saves handed over so far are done, or after the timeout."""
        ...

    def tier_stats(self) -> list[KVTierStats]: ...

    def shutdown(self) -> None: ...


class RemoteKVPull(Protocol):
    def pull(self, params: KVTransferParams, skip_blocks: int = 0) -> int:
        """Fetches the blocks a prefill replica holds for a request (`do_remote_prefill` params), but the first
        `skip_blocks` (this engine holds them already), to where the scheduler side's lookup finds them; returns how
        many arrived. The producer releases them all either way. Thread-safe; never raises."""
        ...


@dataclass
class KVConnector:
    """Both halves of one connector, built together (engine/kv_connector/factory.py)."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
    remote: RemoteKVPull | None = None  # a decode replica's pull (TcpConnector, kv_consumer or kv_both)
