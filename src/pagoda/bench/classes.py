"""Latency per request class: by priority and by tenant (when the workload names them) and by prompt-length
bucket, each class with its own percentiles and goodput (requests and tokens per second within the SLO), over
the run's whole duration, so that the classes' throughputs add up to the run's.

A prompt-length bucket is the powers of two that bound it (`129-256` tokens), from the server's count or,
for a request that failed before usage came back, the client's; `unknown` when neither exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.bench.metrics import distribution, meets_slo, request_values
from pagoda.bench.records import RequestRecord

SMALLEST_BUCKET = 64  # tokens: prompts up to this share one bucket
CLASS_PERCENTILES = ("p50", "p90", "p99")


def prompt_bucket(num_tokens: int | None) -> tuple[int, str]:
    """(sort key, label) of the power-of-two bucket holding a prompt of num_tokens."""
    if num_tokens is None:
        return (1 << 62, "unknown")
    upper = SMALLEST_BUCKET
    while upper < num_tokens:
        upper *= 2
    lower = 1 if upper == SMALLEST_BUCKET else upper // 2 + 1
    return (upper, f"{lower}-{upper}")


def classes_of(record: RequestRecord) -> dict[str, tuple[int, str]]:
    """The record's class in each dimension: (sort key, label)."""
    classes = {"prompt_len": prompt_bucket(record.prompt_tokens or record.expected_prompt_tokens)}
    if record.priority is not None:
        classes["priority"] = (record.priority, str(record.priority))
    if record.tenant is not None:
        classes["tenant"] = (0, record.tenant)  # by name
    return classes


def by_class(records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None) -> dict[str, Any]:
    """{dimension: {label: class summary}} with labels in order (priorities ascending, buckets by size)."""
    groups: dict[str, dict[tuple[int, str], list[RequestRecord]]] = {}
    for record in records:
        for dimension, key in classes_of(record).items():
            groups.setdefault(dimension, {}).setdefault(key, []).append(record)
    return {dimension: {label: class_summary(members, duration, slo) for (_, label), members in sorted(found.items())}
            for dimension, found in groups.items()}


def class_summary(records: Sequence[RequestRecord], duration: float, slo: dict[str, float] | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    values = [request_values(r) for r in ok]

    def per_second(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    def kept(name: str) -> dict[str, Any]:
        full = distribution(v[name] for v in values)
        return {key: full[key] for key in ("count", "mean", *CLASS_PERCENTILES)}

    summary: dict[str, Any] = {
        "num_requests": len(records), "num_ok": len(ok),
        "output_throughput": per_second(sum(r.num_output_tokens or 0 for r in ok)),
        "ttft": kept("ttft"), "tpot": kept("tpot"), "e2e": kept("e2e"),
    }
    if slo:
        good = [r for r in records if meets_slo(r, slo)]
        summary["goodput"] = {"good_requests": len(good), "requests_per_s": per_second(len(good)),
                              "output_tokens_per_s": per_second(sum(r.num_output_tokens or 0 for r in good)),
                              "fraction": len(good) / len(records) if records else None}
    return summary
