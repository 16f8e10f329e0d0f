"""Sweep levels and the rule that stops a sweep at saturation (pure: no network)."""

from __future__ import annotations

import math


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


def saturation_reason(points: list[dict], min_gain: float, max_error_fraction: float) -> str | None:
    """Why the sweep should stop after its latest level, or None to go on.

    Each point is {"level", "summary", "client"}. It stops when the client fell behind (higher levels would
    measure the client), when too many requests failed, or when output throughput grew less than `min_gain`
    (a fraction) over the best earlier level: more load no longer buys throughput, only queueing.
    """
    last = points[-1]
    summary = last["summary"]
    if last["client"]["behind"]:
        return f"the client fell behind at level {last['level']:g}; higher levels would measure the client"
    if summary["num_requests"] and summary["num_errors"] / summary["num_requests"] > max_error_fraction:
        return (f"{summary['num_errors']} of {summary['num_requests']} requests failed at level "
                f"{last['level']:g} (over {max_error_fraction:.0%})")
    if len(points) < 2:
        return None
    best = max((p["summary"]["output_throughput"] or 0.0) for p in points[:-1])
    now = summary["output_throughput"] or 0.0
    if best > 0 and now < best * (1 + min_gain):
        return (f"saturated at level {last['level']:g}: output throughput {now:.4g} tok/s grew "
                f"{now / best - 1:+.1%} over the best earlier level ({best:.4g}), less than {min_gain:.0%}")
    return None
