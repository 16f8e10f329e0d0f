"""pagoda's int4 storage, as facts without torch (`pagoda calc` reads them too): half a byte per weight plus,
per group of input columns, a bf16 scale and a bf16 offset (the zero point, stored even when symmetric); and the
options of pagoda's own int4 quantizer (`--quantization int4`, `quantization_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

GROUP_SIZES = (32, 64, 128)  # what pagoda's own quantizer offers
DEFAULT_GROUP_SIZE = 32
GROUP_BYTES = 4  # a bf16 scale and a bf16 offset per group


def bytes_per_weight(group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """0.625 at group size 32 (5 bits a weight), 0.5625 at 64, 0.53125 at 128."""
    return 0.5 + GROUP_BYTES / group_size


@dataclass(frozen=True)
class Int4Options:
    """How pagoda quantizes a checkpoint to int4 at load (`--quantization int4`; model/int4.py)."""

    group_size: int = DEFAULT_GROUP_SIZE
    sym: bool = False  # symmetric: no offset (zero point 8); asymmetric fits each group's [min, max]
    lm_head: bool = True  # quantize the LM head too (the embedding is a gather and stays as loaded)
    search: bool = True  # search each group's clipping range for the least squared error (not just min/max)

    KEYS: ClassVar[tuple[str, ...]] = ("group_size", "sym", "lm_head", "search")

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        for key in ("sym", "lm_head", "search"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"int4 {key} must be true or false, got {getattr(self, key)!r}")

    @classmethod
    def from_dict(cls, options: dict[str, object] | None) -> Int4Options:
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown int4 option(s) {unknown}; known: {list(cls.KEYS)}")
        return cls(**options)  # type: ignore[arg-type]


def int4_options_from(value: Int4Options | Mapping[str, Any] | None) -> Int4Options | None:
    """`quantization_config` as LLM(...) and the CLI take it: a JSON object of int4 options, or Int4Options."""
    if value is None or isinstance(value, Int4Options):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"quantization_config must be a JSON object, got {type(value).__name__}")
    return Int4Options.from_dict(dict(value))
