"""Optional native kernels, compiled on first use; pagoda falls back to torch where they are missing.

`cpu_kernels()` returns the compiled module, or None (with one warning) when the CPU lacks AVX-512
BF16, no compiler is present, the build fails, or PAGODA_DISABLE_KERNELS=1 asks for the torch path.
`avx2_kernels()` returns the smaller module built for AVX2 alone (the int8 and int4 matmuls), for CPUs
without that AVX-512 set.

The targets are defined here; `build.py` compiles each once per version of its sources into
~/.cache/pagoda/kernels/<hash of the sources and flags>/ (shared by every checkout with the same sources), under
a lock that only a live process holds. `make install` builds them, so tests never wait for it.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pagoda.kernels.build import compile_and_load

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Build:
    """One compiled module: its sources and flags, and the CPU features those flags assume."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]


_HEADERS = ("cpu_vec.h", "cpu_ops.h", "cpu_x_codes.h", "cpu_prefill_attention.h")
# -lgomp links the libgomp torch ships (torch/lib is on the link path), the runtime torch loads.
_LINK_FLAGS = ["-lgomp"]
# The full set, for AVX-512 with bf16 dot products (vdpbf16ps), VNNI (vpdpwssd, vpdpbusd) and VBMI (vpermb).
# -fopenmp: at::parallel_for is an inline OpenMP region; compiled without it, every kernel runs on one thread.
# -ffp-contract=off: a multiply and an add that torch rounds separately stay separate (cpu_fused.cpp).
_AVX512 = _Build(
    "pagoda_cpu_kernels",
    ("cpu_gemv.cpp", "cpu_int8.cpp", "cpu_int4.cpp", "cpu_attention.cpp", "cpu_prefill_attention.cpp",
     "cpu_prefill_attention_amx.cpp", "cpu_fused.cpp", "cpu_decode.cpp", "cpu_module.cpp"),
    ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mfma",
     "-fopenmp", "-ffp-contract=off"),
    frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512vbmi"}),
)
# What runs on AVX2 alone (the int8 and int4 matmuls), for CPUs without that AVX-512 set.
_AVX2 = _Build("pagoda_cpu_avx2_kernels", ("cpu_int8.cpp", "cpu_int4.cpp", "cpu_avx2_module.cpp"),
               ("-O3", "-mavx2", "-mfma", "-fopenmp"), frozenset({"avx2", "fma"}))
REQUIRED_CPU_FLAGS = _AVX512.cpu_flags


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_kernel_features() -> bool:
    return not REQUIRED_CPU_FLAGS - cpu_flags()


@functools.cache
def cpu_kernels():
    """The full set of kernels (AVX-512), or None."""
    return _load(_AVX512)


@functools.cache
def avx2_kernels():
    """The AVX2 module (the int8 and int4 matmuls, which the full set has too), or None."""
    return _load(_AVX2)


def _load(build: _Build):
    if os.environ.get("PAGODA_DISABLE_KERNELS") == "1":
        return None
    missing = build.cpu_flags - cpu_flags()
    if missing:
        logger.warning("native CPU kernels (%s) off: the CPU lacks %s", build.name, sorted(missing))
        return None
    try:
        return compile_and_load(build.name, build.sources, _HEADERS, build.flags, tuple(_LINK_FLAGS))
    except Exception as error:  # no compiler, missing headers, ...: the torch path still works
        logger.warning("native CPU kernels (%s) unavailable (%s); using torch", build.name, error)
        return None
