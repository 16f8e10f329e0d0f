"""What a stored KV block is keyed by: the prefix cache's chained block hash (block_hash.py), under a namespace
that says whose KV it is. Two engines share a block only if every input of its values is the same: the model
(its config and weight files), the weights' quantization, the KV's dtype and layout, the rank and the split's
sizes (a rank of a split model holds a share of the KV heads of its stage's layers, and stores only that), the
block size and the value format. Torch-free."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

NAMESPACE_BYTES = 16
HASH_BYTES = 32  # sha256, block_hash.hash_block


@dataclass(frozen=True)
class KVIdentity:
    model_id: str  # kv_connector_extra_config's model_id, else model_fingerprint(checkpoint)
    quantization: str | None
    kv_dtype: str
    kernels: str  # what computes the KV (the native target or "torch"): its rounding is part of the values
    rank: int  # in the split model's world (tensor x pipeline parallel); 0 unsplit
    tp_size: int
    pp_size: int
    block_size: int
    layout: str  # block_format.BlockLayout.describe(): every tensor's dtype and shape

    def namespace(self) -> bytes:
        text = "|".join(str(part) for part in (
            "pagoda-kv-v1", self.model_id, self.quantization, self.kv_dtype, self.kernels, self.rank,
            self.tp_size, self.pp_size, self.block_size, self.layout))
        return hashlib.sha256(text.encode()).digest()[:NAMESPACE_BYTES]


def model_fingerprint(model_dir: str) -> str:
    """The checkpoint, cheaply: its config.json and its weight files' names and sizes (replicas of one checkpoint
    at different paths agree). Weights rewritten in place at the same sizes are not seen: give model_id then."""
    root = Path(model_dir)
    hasher = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        hasher.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        hasher.update(f"{path.name}:{path.stat().st_size}".encode())
    return hasher.hexdigest()[:32]


def block_keys(namespace: bytes, block_hashes: Iterable[bytes]) -> list[bytes]:
    return [namespace + block_hash for block_hash in block_hashes]


def block_hash_of(key: bytes) -> bytes:
    """The prefix-cache hash a key was made from (what KV events report)."""
    return key[NAMESPACE_BYTES:]
