"""Optional native kernels, compiled on first use; pagoda falls back to torch where they are missing.

`cpu_kernels()` returns the compiled module, or None (with one warning) when the CPU lacks AVX-512
BF16, no compiler is present, the build fails, or PAGODA_DISABLE_KERNELS=1 asks for the torch path.
`avx2_kernels()` returns the smaller module built for AVX2 alone (the int8 and int4 matmuls), for CPUs
without that AVX-512 set.

The build lives in ~/.cache/pagoda/kernels/<hash of the sources and flags>/, with the sources copied in:
every checkout with the same sources shares one build (paths never differ, so ninja never rebuilds),
and a changed source gets a directory of its own. `make install` builds it, so tests never wait for it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

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
_CACHE = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda")) / "kernels"
_STALE_LOCK_SECONDS = 900  # a build lock this old belongs to a killed build: torch would wait on it forever


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


def _build_directory(build: _Build) -> tuple[str, Path, list[str]]:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in build.sources + _HEADERS:
        digest.update((here / name).read_bytes())
    digest.update(" ".join(build.flags + tuple(_LINK_FLAGS)).encode())
    version = digest.hexdigest()[:12]
    directory = _CACHE / version
    (directory / "src").mkdir(parents=True, exist_ok=True)
    for name in build.sources + _HEADERS:
        target = directory / "src" / name
        if not target.exists():
            shutil.copyfile(here / name, target)
    sources = [str(directory / "src" / name) for name in build.sources]
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    return f"{build.name}_{version}", directory, sources


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
        from torch.utils.cpp_extension import load

        name, directory, sources = _build_directory(build)
        built = directory / f"{name}.so"
        if built.exists():  # import it directly: torch's loader would take the build lock even to check
            import torch  # noqa: F401  (the extension links against torch's libraries)

            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        logger.info("compiling pagoda's CPU kernels (%s) into %s (once)", build.name, directory)
        return load(name=name, sources=sources, extra_cflags=list(build.flags), extra_ldflags=_LINK_FLAGS,
                    build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler, missing headers, ...: the torch path still works
        logger.warning("native CPU kernels (%s) unavailable (%s); using torch", build.name, error)
        return None
