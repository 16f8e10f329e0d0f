"""The dtypes a model runs in, by name: what config holds (torch-free; model/loader.py maps a name to torch's)."""

from __future__ import annotations

# The dtypes a model runs in, by the name config holds (torch's and vLLM's), with each element's size in bytes.
# Config names dtypes and never holds torch's objects: the model side maps a name to one (model/loader.py).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def dtype_name(dtype: object) -> str:
    """The name config holds for a dtype given by name, alias or torch.dtype (whose str() is "torch.<name>")."""
    name = str(dtype).removeprefix("torch.").lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted([*DTYPE_BYTES, *DTYPE_ALIASES])}")
    return name
