"""Sweep levels and the rule that stops a sweep at saturation (pure: no network)."""

from __future__ import annotations

import math
from typing import Any


def parse_levels(text: str | None, integer: bool) -> list[float]:
    """`1,2,4,8` -> [1, 2, 4, 8]; `inf` is allowed for a rate (everything at once)."""
    if text is None:
        return []
    levels = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        value = int(part) if integer else float(part)
        if not value > 0:
            raise ValueError(f"levels must be > 0, got {part}")
        levels.append(value)
    return levels


def doubling_levels(start: float, maximum: float) -> list[float]:
    """start, 2 start, 4 start, ... up to maximum (the sweep stops earlier at saturation)."""
    if math.isinf(start):
        return [start]
    levels, level = [], start
    while level <= maximum:
        levels.append(level)
        level *= 2
    return levels


def saturation_reason(points: list[dict[str, Any]], min_gain: float, max_error_fraction: float,
                      patience: int = 2) -> str | None:
    """Why the sweep should stop after its latest level, or None to go on.

    Each point is {"level", "summary", "client"}. It stops when the client fell behind (higher levels would
    measure the client), when too many requests failed, or when output throughput has grown less than
    `min_gain` (a fraction) over the best level before them for `patience` levels in a row: more load no
    longer buys throughput, only queueing. (One flat step is not enough: an engine may switch code paths
    between batch sizes, and a shared machine has noisy levels.)
    """
    last = points[-1]
    summary = last["summary"]
    if last["client"]["behind"]:
        return f"the client fell behind at level {last['level']:g}; higher levels would measure the client"
    if summary["num_requests"] and summary["num_errors"] / summary["num_requests"] > max_error_fraction:
        return (f"{summary['num_errors']} of {summary['num_requests']} requests failed at level "
                f"{last['level']:g} (over {max_error_fraction:.0%})")
    if len(points) <= patience:
        return None
    throughputs = [p["summary"]["output_throughput"] or 0.0 for p in points]
    best = max(throughputs[:-patience])
    recent = throughputs[-patience:]
    if best > 0 and all(now < best * (1 + min_gain) for now in recent):
        levels = ", ".join(f"{p['level']:g}" for p in points[-patience:])
        gains = ", ".join(f"{now / best - 1:+.1%}" for now in recent)
        return (f"saturated: output throughput at levels {levels} grew {gains} over the best earlier level "
                f"({best:.4g} tok/s), less than {min_gain:.0%}")
    return None


def slo_capacity(points: list[dict[str, Any]], min_fraction: float,
                 percentile: int | None = None) -> dict[str, Any] | None:
    """The highest load level at which at least `min_fraction` of the requests met the SLO (with `percentile`:
    at which that percentile of each bounded metric is within its bound, failures counting as misses), counting
    only levels below the first one that missed it (a noisy pass above a failure is no capacity). None when no
    SLO was given; level None when even the lowest level missed it.

    Each point is {"level", "load": {"mode"}, "summary": {"goodput": {"fraction", "requests_per_s"}}}; a
    level of None (rate `inf`) ends the walk.
    """
    measured = [p for p in points if p["summary"].get("goodput") is not None]
    if not measured:
        return None
    best = None
    for point in sorted(measured, key=lambda p: math.inf if p["level"] is None else p["level"]):
        if point["level"] is None or not _meets(point["summary"]["goodput"], min_fraction, percentile):
            break
        best = point
    closed = measured[0]["load"]["mode"] == "closed"
    return {
        "min_fraction": min_fraction,
        "percentile": percentile,
        "unit": "concurrency" if closed else "req/s",
        "level": None if best is None else best["level"],
        "goodput_requests_per_s": None if best is None else best["summary"]["goodput"]["requests_per_s"],
        "slo_s": measured[0]["summary"]["goodput"]["slo_s"],
    }


def _meets(goodput: dict[str, Any], min_fraction: float, percentile: int | None) -> bool:
    if percentile is None:
        return goodput["fraction"] is not None and goodput["fraction"] >= min_fraction
    at = goodput["slo_percentiles"].get(f"p{percentile}", {})
    return bool(at) and all(at[name] <= bound for name, bound in goodput["slo_s"].items())
