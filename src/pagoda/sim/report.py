"""A replay's figures: prefix-cache hit rate, how evenly the load spread, latency percentiles, queueing."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from pagoda.sim.autoscale import ScalingLog
from pagoda.sim.fleet import FleetRun, TurnRecord

PERCENTILES = (50, 90, 99)
TIME_BUCKETS = 30  # intervals of the replay the autoscaling report follows


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
    busiest_computed_share the same for the prompt tokens replicas computed (queries - hits); replica_requests
    and replica_computed_tokens those loads per replica, in the router's order."""
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
        "replica_requests": list(routed),
        "replica_computed_tokens": computed,
        **_percentiles("ttft_s", ttft),
        **_percentiles("itl_s", itl),
        **_percentiles("queue_s", queue),
        "output_tokens_per_s": sum(r.output_tokens for r in served) / run.simulated_s if run.simulated_s else 0.0,
        **({} if run.scaling is None else {"autoscale": summarize_scaling(run.scaling, run.records, run.simulated_s)}),
    }


def summarize_scaling(log: ScalingLog, records: Sequence[TurnRecord], simulated_s: float) -> dict[str, Any]:
    """What autoscaling did and what it cost: replicas per poll, scale events, replica-seconds (a slot counts
    from its start until it retires: starting and draining replicas are paid for too), and per interval of
    the replay the TTFT and hit rate of the requests sent in it."""
    timeline = log.timeline
    paid = [(sample["t_s"], sample["provisioned"] + sample["draining"]) for sample in timeline]
    replica_seconds = sum(count * (end[0] - start) for (start, count), end in zip(paid, paid[1:]))
    kinds = [event.kind for event in log.events]
    return {
        "config": dataclasses.asdict(log.config),
        "peak_replicas": max((sample["provisioned"] for sample in timeline), default=0),
        "mean_replicas": replica_seconds / (paid[-1][0] - paid[0][0]) if len(paid) > 1 else 0.0,
        "replica_seconds": replica_seconds,
        "scale_ups": kinds.count("start"),
        "scale_downs": kinds.count("drain") + kinds.count("cancel"),
        "events": [dataclasses.asdict(event) for event in log.events],
        "timeline": timeline,
        "buckets": _buckets(records, simulated_s),
    }


def _buckets(records: Sequence[TurnRecord], simulated_s: float) -> list[dict[str, Any]]:
    width = max(simulated_s, 1e-9) / TIME_BUCKETS
    grouped: list[list[TurnRecord]] = [[] for _ in range(TIME_BUCKETS)]
    for record in records:
        grouped[min(int(record.arrival_s / width), TIME_BUCKETS - 1)].append(record)
    buckets = []
    for index, group in enumerate(grouped):
        served = [r for r in group if r.finish_s is not None]
        prompt_tokens = sum(r.prompt_tokens for r in served)
        buckets.append({
            "start_s": index * width, "requests": len(group), "refused": sum(1 for r in group if r.replica < 0),
            "hit_rate": sum(r.cached_tokens for r in served) / prompt_tokens if prompt_tokens else None,
            **_percentiles("ttft_s", [r.ttft_s for r in served if r.ttft_s is not None])})
    return buckets


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal."""

    def ms(key: str) -> str:
        value = summary[key]
        return "-" if value is None else f"{value * 1e3:.1f}"

    lines = [
        f"replicas {summary['replicas']}  requests {summary['requests']} (served {summary['served']}, "
        f"refused {summary['refused']})  simulated {summary['simulated_s']:.1f} s in {summary['steps']} steps",
        f"prefix-cache hit rate {summary['hit_rate']:.3f}  busiest replica's share of requests "
        f"{summary['busiest_share']:.4f} (fair {summary['fair_share']:.4f}), of computed prompt tokens "
        f"{summary['busiest_computed_share']:.4f}",
        f"TTFT ms p50 {ms('ttft_s_p50')} p90 {ms('ttft_s_p90')} p99 {ms('ttft_s_p99')}  "
        f"ITL ms p50 {ms('itl_s_p50')} p99 {ms('itl_s_p99')}  queue ms p50 {ms('queue_s_p50')} p99 {ms('queue_s_p99')}",
    ]
    scaling = summary.get("autoscale")
    if scaling:
        lines.append(f"autoscaling: peak {scaling['peak_replicas']} replicas, mean {scaling['mean_replicas']:.2f} "
                     f"({scaling['replica_seconds']:.0f} replica-seconds), {scaling['scale_ups']} started, "
                     f"{scaling['scale_downs']} stopped")
    return "\n".join(lines)
