"""The kernel cores without torch: tests/native/simd_kernels_test.cpp (the simd_*.h cores over cpu_simd.h) and
int_kernels_test.cpp (simd_int.h's integer matmul cores), each compiled with every x86 target's instruction-set flags
the host runs (`pagoda.kernels.TARGETS`) and cross-compiled for aarch64 (the NEON forms), run natively and under
qemu-aarch64. Each checks every core against scalar references on seeded inputs and exits non-zero on a failure.
Without the cross toolchain (Debian's g++-aarch64-linux-gnu and qemu-user) the aarch64 test is skipped, except on CI
(`CI` set), where it fails: .ci/run installs them.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from pagoda.kernels import TARGETS, available_targets

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "tests" / "native"
SIMD_TEST, INT_TEST = "simd_kernels_test", "int_kernels_test"
KERNELS = ROOT / "src" / "pagoda" / "kernels"
# -O2 keeps the build light; -ffp-contract=off as the kernel modules build, so that the references' separate
# multiplies and adds stay separate too (GCC contracts them by default on aarch64).
COMMON_FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", f"-I{KERNELS}"]
CROSS_COMPILER = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
TIMEOUT_S = 300


def build(compiler: str, flags: list[str], test: str, binary: Path) -> None:
    command = [compiler, *COMMON_FLAGS, *flags, str(NATIVE / f"{test}.cpp"), "-o", str(binary)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"


def run(command: list[str]) -> list[str]:
    """The program's report lines; fails the test with the report unless every check passed."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    lines = result.stdout.splitlines()
    assert lines[-1].endswith(" 0 failed") and not any(line.startswith("FAIL") for line in lines), result.stdout
    return lines


def isa_flags(target: str) -> list[str]:
    """The target's instruction-set flags (its -m flags), from the one place its build is defined."""
    return [flag for flag in TARGETS[target].flags if flag.startswith("-m")]


X86_TARGETS = [name for name, build in TARGETS.items() if "x86_64" in build.machines]


def run_x86(target: str, test: str, tmp_path: Path) -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64") or target not in available_targets():
        pytest.skip(f"this CPU does not run the {target} target")
    binary = tmp_path / f"{test}_{target}"
    build(shutil.which("g++") or "g++", isa_flags(target), test, binary)
    return run([str(binary)])


@pytest.mark.parametrize("target", X86_TARGETS)
def test_kernel_cores_on_each_x86_target(target: str, tmp_path: Path) -> None:
    lines = run_x86(target, SIMD_TEST, tmp_path)
    lanes = 16 if any(flag.startswith("-mavx512") for flag in isa_flags(target)) else 8
    assert lines[0] == f"target: x86_64, {lanes} fp32 lanes"


@pytest.mark.parametrize("target", X86_TARGETS)
def test_integer_cores_on_each_x86_target(target: str, tmp_path: Path) -> None:
    assert run_x86(target, INT_TEST, tmp_path)[0] == "target: x86_64"


def cross_tools() -> tuple[str, str]:
    compiler, qemu = shutil.which(CROSS_COMPILER), shutil.which(QEMU)
    if compiler is None or qemu is None:
        message = f"no {CROSS_COMPILER} or {QEMU}: `apt-get install g++-aarch64-linux-gnu qemu-user` (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return compiler, qemu


def test_kernel_cores_on_aarch64_under_qemu(tmp_path: Path) -> None:
    compiler, qemu = cross_tools()
    binary = tmp_path / f"{SIMD_TEST}_aarch64"
    build(compiler, ["-static"], SIMD_TEST, binary)  # static: qemu needs no aarch64 library path
    lines = run([qemu, str(binary)])
    assert lines[0] == "target: aarch64, 8 fp32 lanes"
    if "avx2" in available_targets() and platform.machine().lower() in ("x86_64", "amd64"):
        # NEON's 8 lanes keep AVX2's operations and reduction order, so every result, and so every reported
        # error, is the same to the bit.
        assert lines[1:] == run_x86("avx2", SIMD_TEST, tmp_path)[1:]


def test_integer_cores_on_aarch64_under_qemu(tmp_path: Path) -> None:
    compiler, qemu = cross_tools()
    binary = tmp_path / f"{INT_TEST}_aarch64"
    build(compiler, ["-static"], INT_TEST, binary)
    # NEON sums the int8 dots' fp32 lanes in another order than AVX2: each form is held to the references alone.
    assert run([qemu, str(binary)])[0] == "target: aarch64"
