"""Builds the KV connector EngineConfig.kv_transfer_config names, both halves, once, at construction."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import torch

from pagoda.config import EngineConfig
from pagoda.engine.api import KVEventSink
from pagoda.engine.kv_connector.base import KVConnector
from pagoda.engine.kv_connector.counters import TierCounters
from pagoda.engine.kv_connector.keys import KVIdentity, block_hash_of, model_fingerprint
from pagoda.engine.kv_connector.multi import MultiConnectorScheduler, MultiConnectorWorker
from pagoda.engine.kv_connector.offload import BlockHashes, OffloadingScheduler
from pagoda.engine.kv_connector.offload_worker import Agree, OffloadingWorker, block_layout
from pagoda.engine.kv_connector.stores import KVStore, LocalStore
from pagoda.engine.kv_connector.transfer import Endpoint, HeldBlocks, TransferScheduler
from pagoda.engine.kv_connector.transfer_worker import RECEIVED_MEDIUM, BlockPuller, BlockServer, TransferWorker
from pagoda.kv_transfer_config import LOCAL_MEDIUM, KVTransferConfig


def build_kv_connector(config: EngineConfig, transfer: KVTransferConfig, layers: Sequence[Sequence[torch.Tensor]],
                       block_size: int, block_hashes: BlockHashes, events: KVEventSink | None = None) -> KVConnector:
    """layers: each layer's slot-major KV tensors (this rank's). block_hashes: the KV manager's hash chain."""
    if transfer.kv_connector == "MultiConnector":
        children = [build_kv_connector(config, child, layers, block_size, block_hashes, events)
                    for child in transfer.children]
        return KVConnector(MultiConnectorScheduler([child.scheduler for child in children]),
                           MultiConnectorWorker([child.worker for child in children]))
    if transfer.kv_connector == "TcpConnector":
        return build_tcp_connector(config, transfer, layers, block_size, block_hashes)
    worker, namespace = build_offload_worker(config, transfer, layers, block_size, 0, events)
    scheduler = OffloadingScheduler(worker.tiers, namespace, block_size, block_hashes, transfer.loads, transfer.saves)
    return KVConnector(scheduler, worker)


def build_offload_worker(config: EngineConfig, transfer: KVTransferConfig, layers: Sequence[Sequence[torch.Tensor]],
                         block_size: int, rank: int, events: KVEventSink | None = None,
                         agree: Agree = list) -> tuple[OffloadingWorker, bytes]:
    """One rank's OffloadingConnector worker over its own share of the KV and its own tiers, and the namespace of
    its keys (which holds the rank: a rank stores and loads only its share of each block). Under a split model the
    local tier's bytes are shared evenly among the ranks, and only rank 0 reports KV events."""
    options = transfer.offload_options
    assert options is not None
    layout = block_layout(layers, block_size)
    world_size = config.parallel.world_size
    tiers: list[KVStore] = []
    if options.cpu_bytes_to_use:
        def evicted(keys: list[bytes]) -> None:
            if events is not None:
                events.blocks_removed([block_hash_of(key) for key in keys], medium=LOCAL_MEDIUM)

        tiers.append(LocalStore(options.cpu_bytes_to_use // world_size, layout.value_bytes, LOCAL_MEDIUM, evicted))
    if options.shared_store is not None:
        tiers.append(_shared_tier(options.shared_store, options.shared_medium, options.store_timeout_ms / 1e3,
                                  options.reconnect_backoff_s, options.max_reconnect_backoff_s, options.store_ttl_s,
                                  events, follow_evictions=rank == 0))
    namespace = _identity(config, options.model_id, block_size, layout.describe(), rank).namespace()
    return OffloadingWorker(tiers, layers, block_size, events, agree, namespace), namespace


def _shared_tier(url: str, medium: str, timeout_s: float, backoff_s: float, max_backoff_s: float,
                 ttl_s: float | None, events: KVEventSink | None, follow_evictions: bool = True) -> KVStore:
    # the redis client is imported only where a tier needs it
    from pagoda.engine.kv_connector.redis_store import KEY_PREFIX, RedisStore
    from pagoda.engine.kv_connector.shared_evictions import SharedTierEvictions

    counters = TierCounters(medium)

    def removed(block_hashes: list[bytes]) -> None:
        counters.add(evicted_blocks=len(block_hashes))
        if events is not None:
            events.blocks_removed(block_hashes, medium=medium)

    evictions = SharedTierEvictions(url, KEY_PREFIX, removed, timeout_s) if follow_evictions else None
    return RedisStore(url, medium, timeout_s, backoff_s, max_backoff_s, ttl_s, evictions, counters)


def build_tcp_connector(config: EngineConfig, transfer: KVTransferConfig, layers: Sequence[Sequence[torch.Tensor]],
                        block_size: int, block_hashes: BlockHashes) -> KVConnector:
    """Prefill/decode disaggregation (transfer.py): a block server on a producer, a receive buffer and its pull
    on a consumer, both on kv_both."""
    options = transfer.transfer_options
    assert options is not None
    layout = block_layout(layers, block_size)
    namespace = _identity(config, options.model_id, block_size, layout.describe()).namespace()
    server = held = receiving = loads = puller = None
    if transfer.saves:
        held = HeldBlocks()
        server = BlockServer(transfer.kv_ip, transfer.kv_port, held, [t for ts in layers for t in ts], block_size,
                             layout, namespace)
    if transfer.loads:
        buffer = LocalStore(int(transfer.kv_buffer_size), layout.value_bytes, RECEIVED_MEDIUM)
        receiving = OffloadingScheduler([buffer], namespace, block_size, block_hashes, loads=True, saves=False)
        loads = OffloadingWorker([buffer], layers, block_size)
        puller = BlockPuller(buffer, layout, namespace, options.pull_timeout_s)
    engine_id = transfer.engine_id or uuid.uuid4().hex
    endpoint = None if server is None else Endpoint(engine_id, server.host, server.port)
    scheduler = TransferScheduler(block_size, block_hashes, receiving, held,
                                  None if endpoint is None else (lambda: endpoint), options.hold_timeout_s)
    return KVConnector(scheduler, TransferWorker(loads, server, puller), puller)


def _identity(config: EngineConfig, model_id: str | None, block_size: int, layout: str, rank: int = 0) -> KVIdentity:
    return KVIdentity(
        model_id=model_id or model_fingerprint(config.model), quantization=config.quantization,
        kv_dtype=config.dtype, kernels=_kernels(config), rank=rank, tp_size=config.parallel.tensor_parallel_size,
        pp_size=config.parallel.pipeline_parallel_size, block_size=block_size, layout=layout,
    )


def _kernels(config: EngineConfig) -> str:
    if not config.use_kernels or config.device != "cpu":
        return "torch"
    from pagoda.kernels import simd_target

    target, _ = simd_target()
    return target or "torch"
