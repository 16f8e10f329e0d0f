"""A replay's figures: prefix-cache hit rate, how evenly the load spread, latency percentiles, queueing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagoda.sim.fleet import FleetRun

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linear between order statistics (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _percentiles(name: str, values: Sequence[float]) -> dict[str, float | None]:
    return {f"{name}_p{q}": percentile(values, q) for q in PERCENTILES}


def summarize(run: FleetRun) -> dict[str, Any]:
    """The figures of one replay. hit_rate is the replicas' own (vllm:prefix_cache_hits / queries, summed);
    busiest_share the largest share of requests one replica got (1 / replicas when perfectly even), and
    busiest_computed_share the same for the prompt tokens replicas computed (queries - hits)."""
    replicas = run.replicas
    queries = sum(r.prefix_cache_queries for r in replicas)
    hits = sum(r.prefix_cache_hits for r in replicas)
    computed = [r.prefix_cache_queries - r.prefix_cache_hits for r in replicas]
    routed = run.replica_requests
    served = [record for record in run.records if record.finish_s is not None]
    ttft = [r.ttft_s for r in served if r.ttft_s is not None]
    itl = [r.itl_s for r in served if r.itl_s is not None]
    queue = [r.queue_s for r in served if r.queue_s is not None]
    return {
        "replicas": len(replicas),
        "requests": len(run.records),
        "served": len(served),
        "refused": sum(1 for record in run.records if record.replica < 0),
        "simulated_s": run.simulated_s,
        "steps": run.num_steps,
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "hit_tokens": hits,
        "busiest_share": max(routed) / sum(routed) if sum(routed) else 0.0,
        "busiest_computed_share": max(computed) / sum(computed) if sum(computed) else 0.0,
        "fair_share": 1 / len(replicas),
        **_percentiles("ttft_s", ttft),
        **_percentiles("itl_s", itl),
        **_percentiles("queue_s", queue),
        "output_tokens_per_s": sum(r.output_tokens for r in served) / run.simulated_s if run.simulated_s else 0.0,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal."""

    def ms(key: str) -> str:
        value = summary[key]
        return "-" if value is None else f"{value * 1e3:.1f}"

    return "\n".join([
        f"replicas {summary['replicas']}  requests {summary['requests']} (served {summary['served']}, "
        f"refused {summary['refused']})  simulated {summary['simulated_s']:.1f} s in {summary['steps']} steps",
        f"prefix-cache hit rate {summary['hit_rate']:.3f}  busiest replica's share of requests "
        f"{summary['busiest_share']:.4f} (fair {summary['fair_share']:.4f}), of computed prompt tokens "
        f"{summary['busiest_computed_share']:.4f}",
        f"TTFT ms p50 {ms('ttft_s_p50')} p90 {ms('ttft_s_p90')} p99 {ms('ttft_s_p99')}  "
        f"ITL ms p50 {ms('itl_s_p50')} p99 {ms('itl_s_p99')}  queue ms p50 {ms('queue_s_p50')} p99 {ms('queue_s_p99')}",
    ])
