"""Optional native kernels, compiled on first use; pagoda falls back to torch where they are missing.

Four targets, each one compiled module: on x86, "avx512" (the full set: AVX-512 with BF16, VNNI and VBMI;
prefill attention too, on AMX tiles where granted), "avx512f" (AVX-512 without those) and "avx2" (AVX2 with FMA):
the decode path, from the simd_*.h kernel cores written once over cpu_simd.h, plus the integer matmuls over
simd_int.h; on aarch64, "neon" (the same sources in their NEON forms). `simd_target()` picks the best the CPU has,
or the one PAGODA_SIMD_TARGET names; `cpu_kernels()` returns its module, or None (with one warning) when no
target fits, no compiler is present, the build fails, or PAGODA_DISABLE_KERNELS=1 asks for the torch path.
`target_kernels(name)` loads one target's module whatever was chosen (tests run every target the host has).

The targets are defined here; `build.py` compiles each once per version of its sources into
~/.cache/pagoda/kernels/<hash of the sources and flags>/ (shared by every checkout with the same sources), under
a lock that only a live process holds. `make install` builds them, so tests never wait for it.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.kernels.build import compile_and_load, module_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Build:
    """One compiled module: its sources and flags, the machines (`platform.machine()`) it compiles for, and the CPU
    features those flags assume beyond the machine's baseline."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    machines: frozenset[str] = frozenset({"x86_64", "amd64"})
    picked: bool = True  # simd_target() picks it where the CPU runs it; else only PAGODA_SIMD_TARGET does


_HEADERS = (
    "cpu_vec.h", "cpu_simd.h", "cpu_ops.h", "cpu_bindings.h", "cpu_x_codes.h", "cpu_prefill_attention.h", "simd_gemv.h",
    "simd_fused.h", "simd_attention.h", "simd_lora.h", "simd_int.h", "simd_tensors.h", "kv_quant.h", "cpu_kv_cache.h",
    "cpu_attention_int8.h", "cpu_decode_linear.h", "cpu_decode_moe.h",
)
# -lgomp links the libgomp torch ships (torch/lib is on the link path), the runtime torch loads.
_LINK_FLAGS = ["-lgomp"]
# The full set, for AVX-512 with bf16 dot products (vdpbf16ps), VNNI (vpdpwssd, vpdpbusd) and VBMI (vpermb).
# -fopenmp: at::parallel_for is an inline OpenMP region; compiled without it, every kernel runs on one thread.
# -ffp-contract=off: a multiply and an add that torch rounds separately stay separate (cpu_fused.cpp).
_AVX512 = _Build(
    "pagoda_cpu_kernels",
    ("cpu_gemv.cpp", "cpu_int8.cpp", "cpu_int4.cpp", "cpu_attention.cpp", "cpu_prefill_attention.cpp",
     "cpu_prefill_attention_amx.cpp", "cpu_fused.cpp", "cpu_decode.cpp", "cpu_shm_reduce.cpp", "simd_lora.cpp",
     "cpu_module.cpp"),
    ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mfma",
     "-fopenmp", "-ffp-contract=off"),
    frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512vbmi"}),
)
# The decode path on AVX2 + FMA alone, or on aarch64's NEON (which every aarch64 CPU has): GEMVs, fused ops and
# decode attention over cpu_simd.h's 8 lanes, the integer matmuls, and the native decode stack over them.
_PORTABLE_SOURCES = ("simd_gemv.cpp", "simd_fused.cpp", "simd_attention.cpp", "cpu_int8.cpp", "cpu_int4.cpp",
                     "cpu_decode.cpp", "cpu_shm_reduce.cpp", "simd_lora.cpp", "cpu_simd_module.cpp")
# The same on AVX-512 without the full set's BF16/VNNI/VBMI (Skylake-SP, Cascade Lake; Ice Lake lacks BF16): the
# portable sources with cpu_simd.h's 16 lanes (the integer matmuls keep their AVX2 form). Opt-in: on the one
# AVX-512 host measured (Zen 4, whose 512-bit FMAs take two 256-bit slots) it trails the avx2 module from 32 rows
# on (docs/performance.md); where 512-bit FMAs are native (two units) it should lead, which is not measured yet.
_AVX512F = _Build("pagoda_cpu_avx512f_kernels", _PORTABLE_SOURCES,
                  ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp",
                   "-ffp-contract=off"),
                  frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}), picked=False)
_AVX2 = _Build("pagoda_cpu_avx2_kernels", _PORTABLE_SOURCES,
               ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"), frozenset({"avx2", "fma"}))
_NEON = _Build("pagoda_cpu_neon_kernels", _PORTABLE_SOURCES, ("-O3", "-fopenmp", "-ffp-contract=off"), frozenset(),
               frozenset({"aarch64", "arm64"}))
TARGETS = {"avx512": _AVX512, "avx512f": _AVX512F, "avx2": _AVX2, "neon": _NEON}  # preferred first
TARGET_ENV = "PAGODA_SIMD_TARGET"
REQUIRED_CPU_FLAGS = _AVX512.cpu_flags


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# fp16 arithmetic in hardware (x86): without one of these, torch runs fp16 matmuls through conversions.
NATIVE_FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_lacks_native_fp16() -> bool:
    """True only where it is known: an x86 CPU whose flags name no fp16 arithmetic."""
    return _is_x86() and not NATIVE_FP16_CPU_FLAGS & cpu_flags()


# What torch's libraries are told under a forced PAGODA_SIMD_TARGET, so that a forced run stands in for a host of
# that kind whole: oneDNN's and MKL's GEMMs and ATen's own vector loops held to it too (each reads its variable at
# first use; set before torch is imported). Without them a forced run's prefill GEMMs keep the host's AVX-512 BF16.
TORCH_ISA_CAPS = {
    "avx512f": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def cap_torch_isa() -> None:
    """Under a forced target, holds torch's libraries to it (as defaults: a variable already set is kept)."""
    for name, value in TORCH_ISA_CAPS.get(os.environ.get(TARGET_ENV, ""), {}).items():
        os.environ.setdefault(name, value)


# bf16 arithmetic in hardware (x86): without one of these, torch's bf16 GEMMs (oneDNN) emulate it, several times
# slower than its fp32 ones (docs/performance.md).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_lacks_native_bf16() -> bool:
    """True only where it is known: an x86 CPU whose flags name no bf16 arithmetic, or a PAGODA_SIMD_TARGET whose
    flags name none (avx2) standing in for one."""
    if not _is_x86():
        return False
    forced = TARGETS.get(os.environ.get(TARGET_ENV, ""))
    return not NATIVE_BF16_CPU_FLAGS & (cpu_flags() if forced is None else forced.cpu_flags & cpu_flags())


def cpu_has_kernel_features() -> bool:
    return not REQUIRED_CPU_FLAGS - cpu_flags()


def _unfit(build: _Build, flags: frozenset[str]) -> str | None:
    """Why this machine cannot run the build, or None when it can."""
    if platform.machine().lower() not in build.machines:
        return f"it is for {'/'.join(sorted(build.machines))}, this machine is {platform.machine()}"
    missing = build.cpu_flags - flags
    return f"the CPU lacks {', '.join(sorted(missing))}" if missing else None


def simd_target() -> tuple[str | None, str]:
    """(the target the kernels run, why): the best the CPU has, or PAGODA_SIMD_TARGET's if the CPU has it;
    (None, why not) when none fits."""
    flags = cpu_flags()
    forced = os.environ.get(TARGET_ENV)
    if forced:
        if forced not in TARGETS:
            return None, f"{TARGET_ENV}={forced} is not a target ({', '.join(TARGETS)})"
        unfit = _unfit(TARGETS[forced], flags)
        if unfit:
            return None, f"{TARGET_ENV}={forced}, but {unfit}"
        return forced, f"{TARGET_ENV}={forced}"
    best = "the best this CPU has"
    for name, build in TARGETS.items():
        if not build.picked or platform.machine().lower() not in build.machines:
            continue
        unfit = _unfit(build, flags)
        if unfit is None:
            return name, best
        best = f"{unfit} for {name}"
    return None, best


def available_targets() -> list[str]:
    """The targets this CPU runs, best first."""
    flags = cpu_flags()
    return [name for name, build in TARGETS.items() if _unfit(build, flags) is None]


def cpu_kernels() -> Any:
    """The chosen target's module (`simd_target`; model/kernel_protocols.py's CpuKernels types it), or None."""
    target, _ = simd_target()
    return None if target is None else target_kernels(target)


@functools.cache
def target_kernels(target: str) -> Any:
    """One target's module, or None."""
    return _load(TARGETS[target])


def target_module_path(target: str) -> Path:
    """Where one target's module lives in the kernel cache (built or not): what a cross-compiled module is put at."""
    build = TARGETS[target]
    return module_path(build.name, build.sources, _HEADERS, build.flags, tuple(_LINK_FLAGS))


def avx2_kernels() -> Any:
    """The AVX2 module (the int8 and int4 matmuls, which the full set has too), or None."""
    return target_kernels("avx2")


def _load(build: _Build) -> Any:
    if os.environ.get("PAGODA_DISABLE_KERNELS") == "1":
        return None
    unfit = _unfit(build, cpu_flags())
    if unfit:
        logger.warning("native CPU kernels (%s) off: %s", build.name, unfit)
        return None
    try:
        return compile_and_load(build.name, build.sources, _HEADERS, build.flags, tuple(_LINK_FLAGS))
    except Exception as error:  # no compiler, missing headers, ...: the torch path still works
        logger.warning("native CPU kernels (%s) unavailable (%s); using torch", build.name, error)
        return None
