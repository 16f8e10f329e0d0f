"""A stored KV block's bytes: a header (magic, format version, the layout of the tensors it holds, a checksum)
then the payload, each of the layer's slot-major tensors' rows for the block, in order. A value whose header
does not match the engine's layout (another dtype or shape) or whose checksum fails is refused and counted,
never served. Torch-free: the worker side fills and reads the payload.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"PGKV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHII")  # magic, version, layout length, crc32 of the payload


class BlockRefused(ValueError):
    """A stored value that must not be served. `reason`: "corrupt" (bad magic, length or checksum) or
    "mismatch" (another format version or layout)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class TensorSpec:
    """One slot-major tensor's rows for one block: its dtype's name, the block's shape in it, its size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Every tensor a block is stored as, in order: every layer's, each of the layer's slot-major tensors."""

    tensors: tuple[TensorSpec, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(spec.num_bytes for spec in self.tensors)

    def describe(self) -> str:
        return json.dumps([[spec.dtype, list(spec.shape)] for spec in self.tensors], separators=(",", ":"))

    @property
    def value_bytes(self) -> int:
        return _HEADER.size + len(self.describe().encode()) + self.payload_bytes


def encode_block(layout: BlockLayout, payload: bytes | memoryview) -> bytes:
    described = layout.describe().encode()
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"payload of {len(payload)} bytes for a layout of {layout.payload_bytes}")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(described), zlib.crc32(payload))
    return b"".join((header, described, payload))


def decode_block(layout: BlockLayout, value: bytes) -> memoryview:
    """The payload of a value stored for `layout`; raises BlockRefused when it must not be served."""
    if len(value) < _HEADER.size:
        raise BlockRefused("corrupt", f"{len(value)} bytes, shorter than a header")
    magic, version, described_len, checksum = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BlockRefused("corrupt", "not a pagoda KV block")
    if version != FORMAT_VERSION:
        raise BlockRefused("mismatch", f"format version {version}, not {FORMAT_VERSION}")
    described = bytes(value[_HEADER.size : _HEADER.size + described_len])
    if described != layout.describe().encode():
        raise BlockRefused("mismatch", f"layout {described[:80]!r}")
    payload = memoryview(value)[_HEADER.size + described_len :]
    if len(payload) != layout.payload_bytes:
        raise BlockRefused("corrupt", f"payload of {len(payload)} bytes, not {layout.payload_bytes}")
    if zlib.crc32(payload) != checksum:
        raise BlockRefused("corrupt", "checksum")
    return payload


def layout_of(specs: Sequence[tuple[str, Sequence[int], int]]) -> BlockLayout:
    return BlockLayout(tuple(TensorSpec(dtype, tuple(shape), num_bytes) for dtype, shape, num_bytes in specs))
