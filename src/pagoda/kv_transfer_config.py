"""`--kv-transfer-config` (vLLM's KVTransferConfig as JSON) and vLLM's shorthand `--kv-offloading-size GiB`
`--kv-offloading-backend native`: which KV connector the engine is built with (docs/kv-offload.md).

Torch-free neutral ground: the CLI reads it for `--help`, the engine's factory (engine/kv_connector/) builds the
connector it names. A key pagoda does not take is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30

CONNECTORS = ("OffloadingConnector", "TcpConnector", "MultiConnector")
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
OFFLOADING_BACKENDS = ("native",)
TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_ip", "kv_port",
                 "kv_buffer_size")

# KV events' media (vLLM's names): the engine's own KV pool, whatever the device (as vLLM's num_gpu_blocks counts
# it on a CPU); a host-memory offload tier; and the shared tier's default name (the router counts a block a
# shared medium holds as held by every replica).
DEVICE_MEDIUM = "GPU"
LOCAL_MEDIUM = "CPU"
SHARED_MEDIUM = "SHARED"


@dataclass(frozen=True)
class OffloadOptions:
    """The OffloadingConnector's `kv_connector_extra_config`.

    cpu_bytes_to_use: the local tier's size (vLLM's key; `--kv-offloading-size` GiB); 0: no local tier.
    shared_store: the shared tier's URL (`redis://host:port/db`); None: no shared tier.
    store_timeout_ms: the most one call to a store may wait before the store is bypassed and the tokens computed.
    reconnect_backoff_s / max_reconnect_backoff_s: a store that failed is skipped for this long, doubling up to
    the bound while it keeps failing; the first call that succeeds resets it.
    shared_medium: the medium the shared tier's KV events report.
    store_ttl_s: each block in the shared tier expires this long after it was last stored (None: only the
    store's own eviction, maxmemory LRU, removes it).
    model_id: who may share blocks (default: a digest of the checkpoint's config and weight files' names and sizes).
    """

    cpu_bytes_to_use: int = 0
    shared_store: str | None = None
    store_timeout_ms: float = 100.0
    reconnect_backoff_s: float = 0.5
    max_reconnect_backoff_s: float = 5.0
    shared_medium: str = SHARED_MEDIUM
    store_ttl_s: float | None = None
    model_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cpu_bytes_to_use, bool) or not isinstance(self.cpu_bytes_to_use, int) \
                or self.cpu_bytes_to_use < 0:
            raise ValueError(f"kv_connector_extra_config: cpu_bytes_to_use must be a byte count >= 0, "
                             f"got {self.cpu_bytes_to_use!r}")
        if self.shared_store is not None and not self.shared_store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_connector_extra_config: shared_store must be a redis:// URL, "
                             f"got {self.shared_store!r}")
        for name in ("store_timeout_ms", "reconnect_backoff_s", "max_reconnect_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"kv_connector_extra_config: {name} must be a positive number, got {value!r}")
        ttl = self.store_ttl_s
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise ValueError(f"kv_connector_extra_config: store_ttl_s must be a positive number of seconds, "
                             f"got {self.store_ttl_s!r}")
        if self.cpu_bytes_to_use == 0 and self.shared_store is None:
            raise ValueError("OffloadingConnector needs a tier: cpu_bytes_to_use > 0 (--kv-offloading-size) "
                             "or shared_store")
        if self.shared_medium in ("GPU", LOCAL_MEDIUM):
            raise ValueError(f"kv_connector_extra_config: shared_medium {self.shared_medium!r} names another tier")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> OffloadOptions:
        known = [name for name in cls.__dataclass_fields__]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"OffloadingConnector: unsupported kv_connector_extra_config key(s) {', '.join(unknown)}; "
                             f"pagoda takes {', '.join(known)}")
        return cls(**values)


@dataclass(frozen=True)
class TransferOptions:
    """The TcpConnector's `kv_connector_extra_config` (prefill/decode disaggregation, docs/disaggregation.md).

    hold_timeout_s: how long a prefill replica holds a finished prompt's blocks for a decode replica to pull;
    then they go back to its pool (still in its prefix cache) and a late pull is refused (the decode replica
    computes the prompt).
    pull_timeout_s: the most a decode replica waits on the producer's socket (to connect, and for each read);
    past it the pull is abandoned and the tokens it did not get are computed.
    """

    hold_timeout_s: float = 60.0
    pull_timeout_s: float = 10.0
    model_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("hold_timeout_s", "pull_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"kv_connector_extra_config: {name} must be a positive number, got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TransferOptions:
        known = list(cls.__dataclass_fields__)
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"TcpConnector: unsupported kv_connector_extra_config key(s) {', '.join(unknown)}; "
                             f"pagoda takes {', '.join(known)}")
        return cls(**values)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's KVTransferConfig, the fields pagoda takes. MultiConnector's extra config is vLLM's:
    `{"connectors": [KVTransferConfig, ...]}`, loading from the first that has the tokens, saving to all."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    # The TcpConnector's (vLLM's names): this engine's id in the kv_transfer_params it answers (None: drawn at
    # start); the address its block server listens on and tells decode replicas (port 0: any free port); the
    # bytes of the decode side's receive buffer, where pulled blocks wait for their request's admission.
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_size: int = 1_000_000_000

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not built; pagoda has {', '.join(CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        self.offload_options  # noqa: B018  (checked at construction, not at first use)
        self.transfer_options  # noqa: B018
        self.children  # noqa: B018
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a TCP port (0: any free one), got {self.kv_port!r}")
        if isinstance(self.kv_buffer_size, bool) or not isinstance(self.kv_buffer_size, (int, float)) \
                or self.kv_buffer_size <= 0:
            raise ValueError(f"kv_transfer_config: kv_buffer_size must be a positive byte count, "
                             f"got {self.kv_buffer_size!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError("kv_transfer_config: kv_ip must be a host name or address")

    @property
    def offload_options(self) -> OffloadOptions | None:
        if self.kv_connector != "OffloadingConnector":
            return None
        return OffloadOptions.from_dict(self.kv_connector_extra_config)

    @property
    def transfer_options(self) -> TransferOptions | None:
        if self.kv_connector != "TcpConnector":
            return None
        return TransferOptions.from_dict(self.kv_connector_extra_config)

    @property
    def children(self) -> tuple[KVTransferConfig, ...]:
        if self.kv_connector != "MultiConnector":
            return ()
        extra = dict(self.kv_connector_extra_config)
        connectors = extra.pop("connectors", None)
        if extra:
            raise ValueError(f"MultiConnector: unsupported kv_connector_extra_config key(s) {', '.join(sorted(extra))}")
        if not isinstance(connectors, list) or not connectors:
            raise ValueError('MultiConnector needs kv_connector_extra_config {"connectors": [...]}, a non-empty list')
        children = []
        for child in connectors:
            if not isinstance(child, Mapping):
                raise ValueError("MultiConnector: each of connectors must be a JSON object")
            children.append(KVTransferConfig.from_dict(child))
        return tuple(children)

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVTransferConfig:
        unknown = sorted(set(values) - set(TRANSFER_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unsupported key(s) {', '.join(unknown)}; "
                             f"pagoda takes {', '.join(TRANSFER_KEYS)}")
        if "kv_connector" not in values:
            raise ValueError(f"kv_transfer_config needs kv_connector, one of {', '.join(CONNECTORS)}")
        extra = values.get("kv_connector_extra_config") or {}
        if not isinstance(extra, Mapping):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
        top = {key: values[key] for key in ("engine_id", "kv_ip", "kv_port", "kv_buffer_size") if key in values}
        return cls(values["kv_connector"], values.get("kv_role", "kv_both"), dict(extra), **top)


def kv_transfer_config_from(value: KVTransferConfig | Mapping[str, Any] | None) -> KVTransferConfig | None:
    """`kv_transfer_config` as LLM(...) and the CLI take it: vLLM's JSON object, a KVTransferConfig or None."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
    return KVTransferConfig.from_dict(value)


def offloading_shorthand(size_gib: float, backend: str | None) -> KVTransferConfig:
    """vLLM's `--kv-offloading-size GiB --kv-offloading-backend native`: an OffloadingConnector with a local tier of
    that size."""
    if backend not in (None, *OFFLOADING_BACKENDS):
        raise ValueError(f"kv_offloading_backend {backend!r} is not built; pagoda has {', '.join(OFFLOADING_BACKENDS)}")
    if not size_gib > 0:
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size_gib!r}")
    return KVTransferConfig("OffloadingConnector", "kv_both", {"cpu_bytes_to_use": int(size_gib * GIB)})
