"""The KV cache's storage formats (`--kv-cache-dtype`), as facts without torch: the engine's pool sizing and
`pagoda calc` both read the bytes a token's K and V take from here, scales included.

- "auto": the model's dtype.
- "fp8_e4m3" (vLLM's "fp8"): one byte an element, e4m3 with no infinities (torch.float8_e4m3fn), divided by a
  per-layer scale for K and one for V (1.0, or with --calculate-kv-scales amax / 448 of the first K/V written).
- "int8" (a pagoda extension): one byte an element, symmetric codes with an fp32 scale per token and KV head
  (amax / 127), stored beside the codes in the same slot-major layout.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")  # the names --kv-cache-dtype takes
FP8_E4M3_MAX = 448.0  # the largest finite e4m3 value
INT8_MAX = 127  # symmetric int8 codes: -127..127
SCALE_BYTES = 4  # an fp32 scale
# Element bytes of the formats that are not the model's dtype.
_CODE_BYTES = {"fp8_e4m3": 1, "int8": 1}
# Formats vLLM names that pagoda does not store, with what to use instead.
_REFUSED = {
    "fp8_e5m2": "pagoda stores fp8 as e4m3 only (fp8 or fp8_e4m3), not e5m2",
    "fp8_inc": "Intel Gaudi's fp8 is not stored",
    "fp8_ds_mla": "DeepSeek MLA's fp8 layout is not stored (pagoda runs no MLA model)",
}


def kv_cache_dtype_name(name: str) -> str:
    """The format --kv-cache-dtype names, normalised ("fp8" is "fp8_e4m3"); refuses what pagoda does not store."""
    key = name.lower()
    if key in _REFUSED:
        raise ValueError(f"kv_cache_dtype {name!r}: {_REFUSED[key]}; supported: {', '.join(KV_CACHE_DTYPES)}")
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; supported: {', '.join(KV_CACHE_DTYPES)}")
    return "fp8_e4m3" if key == "fp8" else key


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype_name(kv_cache_dtype) in _CODE_BYTES


def kv_bytes_per_head(head_dim: int, kv_cache_dtype: str, model_dtype_bytes: float) -> float:
    """The bytes one token's K (or V) takes in one KV head: the codes, plus int8's per-token scale (fp8's
    per-layer scale is not per token: nothing). "auto" stores the model's dtype, `model_dtype_bytes` each."""
    name = kv_cache_dtype_name(kv_cache_dtype)
    if name == "auto":
        return head_dim * model_dtype_bytes
    return head_dim * _CODE_BYTES[name] + (SCALE_BYTES if name == "int8" else 0)
