"""Metric definitions, as pure functions of request records (no network, no clock). See docs/bench.md.

- TTFT: from sending a request to the first chunk that carries content (text, or a chat delta's content).
- E2E: from sending a request to the end of its response.
- TPOT: (E2E - TTFT) / (n - 1) per request, n = output tokens (server usage); undefined for n < 2.
- ITL: every gap between consecutive content chunks of a request (a chunk may hold several tokens).
- Throughputs: totals over successful requests divided by the measured duration (first send to last end).
- Goodput: successful requests that meet every SLO, and their output tokens, per second of the same duration.
Distributions report mean, p50, p90, p95, p99 (linear interpolation between order statistics), min, max.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from pagoda.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


def tpot(e2e: float | None, ttft: float | None, num_output_tokens: int | None) -> float | None:
    """Time per output token after the first: (E2E - TTFT) / (n - 1); None when n < 2 or a time is missing."""
    if e2e is None or ttft is None or num_output_tokens is None or num_output_tokens < 2:
        return None
    return (e2e - ttft) / (num_output_tokens - 1)


def inter_chunk_gaps(chunk_times: Sequence[float]) -> list[float]:
    """ITL samples of one request: every gap between consecutive content chunks."""
    return [later - earlier for earlier, later in zip(chunk_times, chunk_times[1:])]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, interpolating linearly (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def distribution(values: Iterable[float | None]) -> dict[str, Any]:
    """count, mean, p50, p90, p95, p99, min, max of the values that are not None (all None when empty)."""
    data = sorted(v for v in values if v is not None)
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "min", "max"]
    if not data:
        return {"count": 0, **dict.fromkeys(keys)}
    result = {"count": len(data), "mean": sum(data) / len(data)}
    result.update({f"p{q}": percentile(data, q) for q in PERCENTILES})
    result.update({"min": data[0], "max": data[-1]})
    return result


def measured_duration(records: Sequence[RequestRecord]) -> float:
    """From the first request sent to the last response over (0 when nothing was sent)."""
    if not records:
        return 0.0
    start = min(r.sent for r in records)
    end = max(r.sent + (r.end if r.end is not None else 0.0) for r in records)
    return max(end - start, 0.0)


# --- SLOs and goodput --------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=200ms,tpot=50ms,e2e=2s` -> {"ttft": 0.2, "tpot": 0.05, "e2e": 2.0}; a bare number is milliseconds."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip().lower()
        match = _DURATION.match(value)
        if name not in SLO_METRICS or not match:
            raise ValueError(f"bad SLO {part!r}: expected NAME=VALUE[ms|s] with NAME in {', '.join(SLO_METRICS)}")
        number, unit = float(match.group(1)), match.group(2) or "ms"
        slo[name] = number / 1000.0 if unit == "ms" else number
    return slo


def request_values(record: RequestRecord) -> dict[str, float | None]:
    """The per-request latencies an SLO can bound; ITL is the request's worst gap."""
    gaps = inter_chunk_gaps(record.chunk_times)
    return {
        "ttft": record.ttft,
        "tpot": tpot(record.e2e, record.ttft, record.num_output_tokens),
        "itl": max(gaps) if gaps else None,
        "e2e": record.e2e,
    }


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Succeeded and within every bound; a metric the request does not have (TPOT of one token) passes."""
    if not record.ok:
        return False
    values = request_values(record)
    return all((value := values[name]) is None or value <= bound for name, bound in slo.items())


# --- the summary of one run --------------------------------------------------------------------------------


def token_checks(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Server usage cross-checked with the client's own counts."""
    ok = [r for r in records if r.ok]
    with_expected = [r for r in ok if r.expected_prompt_tokens is not None and r.prompt_tokens is not None]
    # (server's count, client's count) of each answer that has both
    with_client = [(r.output_tokens, r.client_output_tokens) for r in ok
                   if r.output_tokens is not None and r.client_output_tokens is not None]
    server_out = sum(server for server, _ in with_client)
    client_out = sum(client for _, client in with_client)
    return {
        "usage_missing": sum(1 for r in ok if r.output_tokens is None or r.prompt_tokens is None),
        "prompt_checked": len(with_expected),
        "prompt_mismatches": sum(1 for r in with_expected if r.prompt_tokens != r.expected_prompt_tokens),
        "output_checked": len(with_client),
        "output_client_over_server": client_out / server_out if server_out else None,
        "cached_prompt_tokens": sum(r.cached_tokens or 0 for r in ok),
        "short_outputs": sum(1 for r in ok if r.num_output_tokens is not None and r.num_output_tokens < r.max_tokens),
    }


def summarize(records: Sequence[RequestRecord], duration: float | None = None,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Everything the report shows about one run. Latencies are in seconds, throughputs per second."""
    duration = measured_duration(records) if duration is None else duration
    ok = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens or r.expected_prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.num_output_tokens or 0 for r in ok)

    def per_second(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    values = [request_values(r) for r in ok]
    summary = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "duration_s": duration,
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "input_throughput": per_second(prompt_tokens),
        "output_throughput": per_second(output_tokens),
        "total_throughput": per_second(prompt_tokens + output_tokens),
        "ttft": distribution(v["ttft"] for v in values),
        "tpot": distribution(v["tpot"] for v in values),
        "itl": distribution(gap for r in ok for gap in inter_chunk_gaps(r.chunk_times)),
        "e2e": distribution(v["e2e"] for v in values),
        "tokens": token_checks(records),
    }
    if slo:
        good = [r for r in records if meets_slo(r, slo)]
        summary["goodput"] = {
            "slo_s": dict(slo),
            "good_requests": len(good),
            "requests_per_s": per_second(len(good)),
            "output_tokens_per_s": per_second(sum(r.num_output_tokens or 0 for r in good)),
            "fraction": len(good) / len(records) if records else None,
            "slo_percentiles": slo_percentiles(records, slo),
        }
    return summary


def slo_percentiles(records: Sequence[RequestRecord], slo: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each bounded metric's percentiles over every request, a failed one counting as infinitely slow and a
    metric a request does not have (TPOT of one token) as 0, as meets_slo treats them: `p99 TTFT <= 500 ms`
    then says 99% of requests got their first token within 500 ms."""
    per_metric: dict[str, list[float]] = {name: [] for name in slo}
    for record in records:
        values = request_values(record) if record.ok else {}
        for name in slo:
            value = values.get(name, math.inf) if record.ok else math.inf
            per_metric[name].append(0.0 if value is None else value)
    return {f"p{q}": {name: percentile(sorted(data), q) for name, data in per_metric.items() if data}
            for q in PERCENTILES}


# --- the client's own honesty --------------------------------------------------------------------------------


def client_verdict(
    dispatch_lags: Sequence[float],
    loop_lags: Sequence[float],
    cpu_fraction: float | None,
    tolerance_s: float,
    *,
    relative: float = 0.0,
    itl_p50: float | None = None,
    mean_interarrival: float | None = None,
) -> dict[str, Any]:
    """Did the client fall behind? Its numbers are then the client's delay as much as the server's.

    dispatch lag: how late open-loop requests went out against their schedule. loop lag: how late the event
    loop woke up against a timer; every timestamp taken meanwhile is late by as much. Either one's p99 over
    its tolerance means behind. A tolerance is `tolerance_s`, or `relative` times the interval it would
    distort when that is larger: the median inter-chunk gap (loop lag) or the mean gap between arrivals
    (dispatch lag), so that a 30 ms stall is not "behind" when chunks are a second apart.
    cpu_fraction: client CPU seconds per wall second; near 1 the single-threaded client is saturated (a warning).
    """
    dispatch, loop = distribution(dispatch_lags), distribution(loop_lags)
    dispatch_tolerance = max(tolerance_s, relative * (mean_interarrival or 0.0))
    loop_tolerance = max(tolerance_s, relative * (itl_p50 or 0.0))
    reasons = []
    if dispatch["count"] and dispatch["p99"] > dispatch_tolerance:
        reasons.append(f"requests went out late: p99 dispatch lag {dispatch['p99'] * 1e3:.1f} ms "
                       f"(max {dispatch['max'] * 1e3:.1f} ms) > {dispatch_tolerance * 1e3:.0f} ms")
    if loop["count"] and loop["p99"] > loop_tolerance:
        reasons.append(f"the client's event loop stalled: p99 timer lag {loop['p99'] * 1e3:.1f} ms "
                       f"(max {loop['max'] * 1e3:.1f} ms) > {loop_tolerance * 1e3:.0f} ms, so timestamps are late")
    warnings = []
    if cpu_fraction is not None and cpu_fraction > 0.9:
        warnings.append(f"the client used {cpu_fraction:.0%} of a CPU core: it may be the bottleneck")
    return {"behind": bool(reasons), "reasons": reasons, "warnings": warnings,
            "tolerance_s": {"dispatch": dispatch_tolerance, "loop": loop_tolerance},
            "dispatch_lag": dispatch, "loop_lag": loop, "cpu_fraction": cpu_fraction}
