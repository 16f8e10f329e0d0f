"""Optional native kernels, compiled on first use; pagoda falls back to torch where they are missing.

`cpu_kernels()` returns the compiled module, or None (with one warning) when the CPU lacks AVX-512
BF16, no compiler is present, the build fails, or PAGODA_DISABLE_KERNELS=1 asks for the torch path.

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
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_prefill_attention.cpp", "cpu_fused.cpp",
                 "cpu_decode.cpp", "cpu_module.cpp")
]
_HEADERS = [Path(__file__).with_name(name) for name in ("cpu_vec.h", "cpu_ops.h")]
# -fopenmp: at::parallel_for is an inline OpenMP region; compiled without it, every kernel runs on one
# thread. -lgomp links the libgomp torch ships (torch/lib is on the link path), the runtime torch loads.
# -ffp-contract=off: a multiply and an add that torch rounds separately stay separate (cpu_fused.cpp).
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp",
          "-ffp-contract=off"]
_LINK_FLAGS = ["-lgomp"]
_CACHE = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda")) / "kernels"
_STALE_LOCK_SECONDS = 900  # a build lock this old belongs to a killed build: torch would wait on it forever


# What the kernels are compiled for: AVX-512 with bf16 dot products (vdpbf16ps) and VNNI (vpdpwssd).
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"})


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


def _build_directory() -> tuple[str, Path, list[str]]:
    digest = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_FLAGS + _LINK_FLAGS).encode())
    version = digest.hexdigest()[:12]
    directory = _CACHE / version
    (directory / "src").mkdir(parents=True, exist_ok=True)
    for source in _SOURCES + _HEADERS:
        target = directory / "src" / source.name
        if not target.exists():
            shutil.copyfile(source, target)
    sources = [str(directory / "src" / source.name) for source in _SOURCES]
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    return f"pagoda_cpu_kernels_{version}", directory, sources


@functools.cache
def cpu_kernels():
    if os.environ.get("PAGODA_DISABLE_KERNELS") == "1":
        return None
    missing = REQUIRED_CPU_FLAGS - cpu_flags()
    if missing:
        logger.warning("native CPU kernels off: the CPU lacks %s; using torch", sorted(missing))
        return None
    try:
        from torch.utils.cpp_extension import load

        name, directory, sources = _build_directory()
        built = directory / f"{name}.so"
        if built.exists():  # import it directly: torch's loader would take the build lock even to check
            import torch  # noqa: F401  (the extension links against torch's libraries)

            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        logger.info("compiling pagoda's CPU kernels into %s (once)", directory)
        return load(name=name, sources=sources, extra_cflags=_FLAGS, extra_ldflags=_LINK_FLAGS,
                    build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler, missing headers, ...: the torch path still works
        logger.warning("native CPU kernels unavailable (%s); using torch", error)
        return None

