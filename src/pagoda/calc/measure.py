"""Measure this machine's memory bandwidth and matmul rate, for `--gpu this-machine`.

Small and quick (well under a second): a STREAM-style copy larger than any last-level cache and a few
fp32 matmuls, best of a few runs. numpy is imported here, lazily, so plain `pagoda calc` stays instant.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from pagoda.calc.shapes import GpuSpec

MiB = 2**20


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (0 if unknown), so the copy can be sized to miss it."""
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes)


def default_copy_bytes() -> int:
    # 4x the last-level cache keeps the copy in DRAM; at least 128 MiB where the cache is unknown.
    return max(128 * MiB, 4 * last_level_cache_bytes())


def measure_copy_bandwidth(copy_bytes: int, repeats: int = 3) -> float:
    """Bytes/s of a large array copy, counting read + write as STREAM does (write-allocate not counted)."""
    import numpy as np

    src = np.ones(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    seconds = _best_seconds(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / seconds


def measure_matmul_flops(size: int = 1024, repeats: int = 3) -> float:
    """flop/s of an fp32 square matmul through numpy's BLAS (all the threads it is allowed)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b  # warm-up: BLAS thread pool start, page faults
    seconds = _best_seconds(lambda: a @ b, repeats)
    return 2 * size**3 / seconds


def physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not every platform exposes these
        return 0.0


def measure_this_machine(copy_bytes: int | None = None, matmul_size: int = 1024) -> GpuSpec:
    copy_bytes = copy_bytes or default_copy_bytes()
    bandwidth = measure_copy_bandwidth(copy_bytes)
    flops = measure_matmul_flops(matmul_size)
    return GpuSpec(
        "this machine",
        peak_tflops=flops / 1e12,
        bandwidth_tbps=bandwidth / 1e12,
        memory_gb=physical_memory_bytes() / 1e9,
        interconnect_gbps=None,
        source=f"measured: numpy fp32 {matmul_size}^3 matmul, {copy_bytes // MiB} MiB copy",
    )
