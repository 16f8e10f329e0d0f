"""The PNG `pagoda sim --output` writes beside its JSON: the policies side by side.

Top row, one bar per policy: the prefix-cache hit rate; the busiest replica's share of requests and of computed
prompt tokens against the fair share; and each replica's share of requests, replicas ranked from the busiest
(log scales: at 1,000 replicas the spread is orders of magnitude). With autoscaling, a second row follows the
replay in time: replicas ready and provisioned, TTFT of the requests sent in each interval, and their hit rate.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def plot_results(results: dict[str, dict[str, Any]], path: Path, title: str = "") -> Path:
    """results: policy -> `report.summarize`'s figures (with its per-replica loads)."""
    # matplotlib logs its font-cache rebuild through logging, which `pagoda`'s INFO handler would print.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = {policy: s["autoscale"] for policy, s in results.items() if s.get("autoscale")}
    rows = 2 if timed else 1
    figure, axes = plt.subplots(rows, 3, figsize=(15, 4.5 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    policies = list(results)
    _hit_rates(axes[0][0], policies, results, colors)
    _busiest(axes[0][1], policies, results, colors)
    _distribution(axes[0][2], policies, results, colors)
    if timed:
        _over_time(axes[1], timed, {p: colors[policies.index(p) % len(colors)] for p in timed})
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _hit_rates(ax: Axes, policies: list[str], results: dict[str, dict[str, Any]], colors: list[str]) -> None:
    rates = [results[p]["hit_rate"] for p in policies]
    bars = ax.bar(policies, rates, color=[colors[i % len(colors)] for i in range(len(policies))])
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prompt tokens served from cache / prompt tokens")
    ax.set_title("Prefix-cache hit rate")


def _busiest(ax: Axes, policies: list[str], results: dict[str, dict[str, Any]], colors: list[str]) -> None:
    width = 0.38
    for i, policy in enumerate(policies):
        s, color = results[policy], colors[i % len(colors)]
        bars = ax.bar([i - width / 2, i + width / 2], [s["busiest_share"], s["busiest_computed_share"]], width,
                      color=color, edgecolor="black", hatch=["", "//"])
        ax.bar_label(bars, fmt="%.4f", fontsize=7)
    fair = results[policies[0]]["fair_share"]
    ax.axhline(fair, color="gray", linestyle=":", label=f"fair share {fair:g}")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_yscale("log")
    ax.set_ylabel("share of the fleet's load (log)")
    ax.set_title("Busiest replica's share: requests | computed prompt tokens (hatched)")
    ax.legend(fontsize=7, loc="upper right")


def _distribution(ax: Axes, policies: list[str], results: dict[str, dict[str, Any]], colors: list[str]) -> None:
    for i, policy in enumerate(policies):
        loads = sorted(results[policy]["replica_requests"], reverse=True)
        total = sum(loads)
        if not total:
            continue
        ax.plot(range(1, len(loads) + 1), [load / total for load in loads], color=colors[i % len(colors)],
                label=policy, drawstyle="steps-post")
    fair = results[policies[0]]["fair_share"]
    ax.axhline(fair, color="gray", linestyle=":", label="fair share")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("replica, ranked from the busiest (log)")
    ax.set_ylabel("its share of requests (log)")
    ax.set_title("Load per replica")
    ax.legend(fontsize=7, loc="upper right")


def _over_time(axes: Any, timed: dict[str, dict[str, Any]], colors: dict[str, str]) -> None:
    replicas_ax, ttft_ax, hit_ax = axes
    for policy, autoscale in timed.items():
        color, samples, buckets = colors[policy], autoscale["timeline"], autoscale["buckets"]
        times = [sample["t_s"] for sample in samples]
        replicas_ax.plot(times, [sample["ready"] for sample in samples], color=color, drawstyle="steps-post",
                         label=f"{policy} ready")
        replicas_ax.plot(times, [sample["provisioned"] for sample in samples], color=color, linestyle="--",
                         drawstyle="steps-post", label=f"{policy} provisioned")
        starts = [bucket["start_s"] for bucket in buckets]
        for key, style in (("ttft_s_p50", "-"), ("ttft_s_p90", "--")):
            ttft_ax.plot(starts, [_ms(bucket[key]) for bucket in buckets], style, marker=".", color=color,
                         label=f"{policy} {key[-3:]}")
        hit_ax.plot(starts, [_f(bucket["hit_rate"]) for bucket in buckets], marker=".", color=color, label=policy)
        bounds = autoscale["config"]
        replicas_ax.axhline(bounds["max_replicas"], color="gray", linestyle=":")
        replicas_ax.axhline(bounds["min_replicas"], color="gray", linestyle=":")
    replicas_ax.set_title("Replicas (dotted: min and max)")
    replicas_ax.set_ylabel("replicas")
    ttft_ax.set_title("TTFT of the requests sent in each interval")
    ttft_ax.set_ylabel("ms")
    hit_ax.set_title("Hit rate of the requests sent in each interval")
    hit_ax.set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("simulated time (s)")
        ax.legend(fontsize=7, loc="upper right")


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1e3


def _f(value: float | None) -> float:
    return float("nan") if value is None else value
