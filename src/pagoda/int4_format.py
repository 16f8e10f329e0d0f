"""pagoda's int4 storage, as facts without torch (`pagoda calc` reads them too): half a byte per weight plus,
per group of input columns, a bf16 scale and a bf16 offset (the zero point, stored even when symmetric)."""

from __future__ import annotations

GROUP_SIZES = (32, 64, 128)  # what pagoda's own quantizer offers
DEFAULT_GROUP_SIZE = 32
GROUP_BYTES = 4  # a bf16 scale and a bf16 offset per group


def bytes_per_weight(group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """0.625 at group size 32 (5 bits a weight), 0.5625 at 64, 0.53125 at 128."""
    return 0.5 + GROUP_BYTES / group_size
