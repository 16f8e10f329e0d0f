"""Optional native kernels, compiled on first use; pagoda falls back to torch where they are missing.

`cpu_kernels()` returns the compiled module, or None (with one warning) when the CPU lacks AVX-512
BF16, no compiler is present, the build fails, or PAGODA_DISABLE_KERNELS=1 asks for the torch path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemv.cpp", "cpu_attention.cpp")]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def cpu_kernels():
    if os.environ.get("PAGODA_DISABLE_KERNELS") == "1":
        return None
    missing = {"avx512f", "avx512bw", "avx512_bf16"} - _cpu_flags()
    if missing:
        logger.warning("native CPU kernels off: the CPU lacks %s; using torch", sorted(missing))
        return None
    try:
        from torch.utils.cpp_extension import load

        logger.info("compiling pagoda's CPU kernels (first use only; cached afterwards)")
        return load(
            name="pagoda_cpu_kernels",
            sources=[str(source) for source in _SOURCES],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"],
            verbose=False,
        )
    except Exception as error:  # no compiler, missing headers, ...: the torch path still works
        logger.warning("native CPU kernels unavailable (%s); using torch", error)
        return None
