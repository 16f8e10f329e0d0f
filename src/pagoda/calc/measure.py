"""Measure this machine's memory bandwidth and matmul rate, for `--gpu this-machine`.

Small and quick (well under a second): a read of an array larger than any last-level cache, split over
every core the process may use (a decode step reads its weights that way), and a few fp32 matmuls, best
of a few runs. numpy is imported here, lazily, so plain `pagoda calc` stays instant.
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
    """The largest CPU cache Linux reports (0 if unknown), so the read can be sized to miss it."""
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes)


def default_read_bytes() -> int:
    # 4x the last-level cache keeps the read in DRAM; at least 128 MiB where the cache is unknown.
    return max(128 * MiB, 4 * last_level_cache_bytes())


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def measure_read_bandwidth(read_bytes: int, repeats: int = 3) -> float:
    """Bytes/s read by summing a large array in one slice per core (numpy frees the GIL while it sums).

    A read, not a STREAM copy: decode streams weights in and writes little, and a single-threaded copy
    undercounts what all cores together pull from DRAM (by about a third on a 2-vCPU host).
    """
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    data = np.ones(read_bytes // 4, dtype=np.float32)
    cores = usable_cores()
    slices = np.array_split(data, cores)
    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(np.sum, slices))  # warm-up: threads started, pages touched
        seconds = _best_seconds(lambda: list(pool.map(np.sum, slices)), repeats)
    return data.nbytes / seconds


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


def measure_this_machine(read_bytes: int | None = None, matmul_size: int = 1024) -> GpuSpec:
    read_bytes = read_bytes or default_read_bytes()
    bandwidth = measure_read_bandwidth(read_bytes)
    flops = measure_matmul_flops(matmul_size)
    return GpuSpec(
        "this machine",
        peak_tflops=flops / 1e12,
        bandwidth_tbps=bandwidth / 1e12,
        memory_gb=physical_memory_bytes() / 1e9,
        interconnect_gbps=None,
        source=f"measured: numpy fp32 {matmul_size}^3 matmul, {read_bytes // MiB} MiB read on {usable_cores()} cores",
    )
