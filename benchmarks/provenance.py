"""What a result was measured with: the source revision (and whether the tree had uncommitted changes) and the
CPU (vendor, family, model, the instruction-set extensions pagoda's kernels care about). Every benchmark writes
its results file through `write_result`, which records them under "provenance".

Standard library only, so that scripts running in their own environment (fuzz.py, with schemathesis) can
record it as well as those in pagoda's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
# The extensions that decide which of pagoda's kernels can run, as /proc/cpuinfo names them.
NOTABLE_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                 "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _git(*arguments: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *arguments], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_revision() -> dict:
    """The commit checked out and whether tracked files differ from it (untracked files do not count)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_revision": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def cpu_summary(cpuinfo: str | None = None) -> dict:
    """The first processor of /proc/cpuinfo: vendor, family, model, name, and which NOTABLE_FLAGS it has."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough: they are alike
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"vendor": fields.get("vendor_id"), "family": fields.get("cpu family"), "model": fields.get("model"),
            "model_name": fields.get("model name"), "flags": [flag for flag in NOTABLE_FLAGS if flag in flags],
            "flag_count": len(flags)}


def provenance() -> dict:
    return {**source_revision(), "cpu": cpu_summary()}


def write_result(path: str | Path, result: dict, indent: int = 2) -> None:
    """Writes `result` as JSON to `path` (its folder made if need be), with the provenance of the run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "provenance": provenance()}, indent=indent, default=str) + "\n")
