"""Compiling a native module once per version of its sources, safely across processes and kills.

Everything lives under <PAGODA_CACHE, default ~/.cache/pagoda>/kernels/:

    <version>/<name>_<version>.so   the finished module; it appears only complete (renamed into place)
    <version>/src/                  the sources, copied: every checkout with the same sources shares one build
    <version>/build.lock            held (flock) by the one process compiling; its text names that process
    <version>/build-<pid>/          that process's build directory (torch + ninja), removed when it is done
    build-seconds.json              how long each module's last build took, for the next build's message

`<version>` hashes the sources, headers and flags, so a changed source gets a directory of its own.

The lock is an flock, which the kernel releases when its holder exits, however it exits: a build killed
midway (SIGKILL included) never blocks the next start, which takes the lock at once and starts again in a
build directory of its own (the killed process's compilers may still be finishing in theirs). A process
that finds another one compiling says so, and whom it waits for, and keeps saying so while it waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("pagoda.kernels")

CACHE = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda")) / "kernels"
WAIT_LOG_INTERVAL_S = 30.0  # how often a process waiting for another one's build says it still waits
_LOCK_POLL_S = 0.2
_BUILD_TIMES = "build-seconds.json"


def compile_and_load(name: str, sources: tuple[str, ...], headers: tuple[str, ...], cflags: tuple[str, ...],
                     ldflags: tuple[str, ...]) -> ModuleType:
    """The module built from `sources` (with `headers`, both in this package's directory) and these flags:
    imported from the cache when built before, else compiled first. Raises if it cannot be built."""
    here = Path(__file__).parent
    built = module_path(name, sources, headers, cflags, ldflags)
    directory, module_name = built.parent, built.stem
    if built.exists():  # imported directly: torch's loader would take its build lock even to check
        return _import(module_name, built)
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory, name):
        if built.exists():  # another process built it while this one waited
            return _import(module_name, built)
        _remove_abandoned_builds(directory)
        for file_name in sources + headers:  # copied afresh: a copy cut short by a kill is never reused
            _atomic_copy(here / file_name, directory / "src" / file_name)
        last = last_build_seconds(name)
        usually = f"the last build here took {last:.0f} s" if last is not None else "usually a minute or two"
        logger.warning("compiling pagoda's CPU kernels (%s) into %s, once for these sources (%s)",
                       name, directory, usually)
        started = time.monotonic()
        module = _compile(module_name, directory, [str(directory / "src" / s) for s in sources], cflags, ldflags)
        elapsed = time.monotonic() - started
        _record_build_seconds(name, elapsed)
        logger.info("compiled %s in %.0f s", name, elapsed)
        return module


def module_path(name: str, sources: tuple[str, ...], headers: tuple[str, ...], cflags: tuple[str, ...],
                ldflags: tuple[str, ...]) -> Path:
    """Where the module built from these sources and flags lives in the cache, built or not:
    <version>/<name>_<version>.so."""
    version = source_version(Path(__file__).parent, sources + headers, cflags + ldflags)
    return CACHE / version / f"{name}_{version}.so"


def source_version(here: Path, files: tuple[str, ...], flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for file_name in files:
        digest.update((here / file_name).read_bytes())
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def build_lock(directory: Path, what: str) -> Iterator[None]:
    """Holds `directory`'s build lock, waiting (and saying so) while another live process holds it."""
    fd = os.open(directory / "build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, what)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, what: str) -> None:
    if _try_lock(fd):
        return
    started = time.monotonic()
    next_log = 0.0
    while not _try_lock(fd):
        waited = time.monotonic() - started
        if waited >= next_log:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            logger.warning("waiting for process %s, which is compiling pagoda's CPU kernels (%s); %.0f s so far",
                           holder, what, waited)
            next_log += WAIT_LOG_INTERVAL_S
        time.sleep(_LOCK_POLL_S)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_abandoned_builds(directory: Path) -> None:
    """Build directories of processes that are gone (killed mid-build): only the lock holder builds."""
    for scratch in directory.glob("build-*"):
        pid = scratch.name.removeprefix("build-")
        if scratch.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _atomic_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def _compile(module_name: str, directory: Path, sources: list[str], cflags: tuple[str, ...],
             ldflags: tuple[str, ...]) -> ModuleType:
    """torch builds in a directory of this process's own; the finished module is then renamed into place,
    so that `<module_name>.so` exists only complete."""
    from torch.utils.cpp_extension import load

    scratch = directory / f"build-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        module: ModuleType = load(name=module_name, sources=sources, extra_cflags=list(cflags),
                                  extra_ldflags=list(ldflags), build_directory=str(scratch), verbose=False)
        os.replace(scratch / f"{module_name}.so", directory / f"{module_name}.so")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return module


def _import(module_name: str, path: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_build_seconds(name: str) -> float | None:
    try:
        seconds = json.loads((CACHE / _BUILD_TIMES).read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return float(seconds) if isinstance(seconds, (int, float)) else None


def _record_build_seconds(name: str, seconds: float) -> None:
    path = CACHE / _BUILD_TIMES
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        times = {}
    if not isinstance(times, dict):
        times = {}
    times[name] = round(seconds, 1)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(times))
        os.replace(partial, path)
    except OSError:  # only the next build's message would have used it
        logger.debug("could not record the build time in %s", path)
