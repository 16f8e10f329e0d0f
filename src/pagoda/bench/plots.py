"""PNG plots of a benchmark: one figure, four panels, one line per endpoint.

throughput vs load | TTFT percentiles vs load | TPOT percentiles vs load | latency vs throughput.
With an SLO, the throughput panel also draws goodput (requests/s that met it, right axis) and marks the
capacity at the SLO with a dotted vertical line.
Levels where the client fell behind are marked with a red x: their numbers are not the server's alone.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PERCENTILE_STYLES = (("p50", "-"), ("p90", "--"), ("p99", ":"))


def _points(endpoint: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in endpoint["levels"] if p["level"] is not None]


def can_plot() -> bool:
    """matplotlib comes with the bench extra; it is imported only when a plot is drawn."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_benchmark(endpoints: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    # matplotlib logs its font-cache rebuild (a first run, a new version) through logging, which `pagoda`'s
    # INFO root handler would print among the results; its errors still show.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed = all(p["load"]["mode"] == "closed" for e in endpoints for p in e["levels"])
    x_label = "concurrency (requests in flight)" if closed else "offered request rate (req/s)"
    figure, axes = plt.subplots(2, 2, figsize=(12, 9))
    (throughput_ax, ttft_ax), (tpot_ax, curve_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    levels = sorted({p["level"] for e in endpoints for p in _points(e)})
    goodput_ax = None
    for index, endpoint in enumerate(endpoints):
        color, name, points = colors[index % len(colors)], endpoint["name"], _points(endpoint)
        if not points:
            continue
        x = [p["level"] for p in points]
        summaries = [p["summary"] for p in points]
        throughput_ax.plot(x, [_f(s["output_throughput"]) for s in summaries], "o-", color=color,
                           label=f"{name} output")
        throughput_ax.plot(x, [_f(s["total_throughput"]) for s in summaries], "s--", color=color, alpha=0.6,
                           label=f"{name} total")
        for ax, metric in ((ttft_ax, "ttft"), (tpot_ax, "tpot")):
            for stat, style in PERCENTILE_STYLES:
                values = [_ms(s[metric][stat]) for s in summaries]
                ax.plot(x, values, style, marker="o", color=color, label=f"{name} {stat}")
        throughputs = [_f(s["output_throughput"]) for s in summaries]
        curve_ax.plot(throughputs, [_f(s["e2e"]["p50"]) for s in summaries], "o-", color=color, label=f"{name} E2E p50")
        curve_ax.plot(throughputs, [_f(s["e2e"]["p99"]) for s in summaries], "o:", color=color, label=f"{name} E2E p99")
        for level, throughput, s in zip(x, throughputs, summaries):
            if throughput is not None and s["e2e"]["p50"] is not None:
                curve_ax.annotate(f"{level:g}", (throughput, s["e2e"]["p50"]), textcoords="offset points",
                                  xytext=(4, 4), fontsize=8)
        if any(s.get("goodput") for s in summaries):
            if goodput_ax is None:
                goodput_ax = throughput_ax.twinx()
                if not closed:  # every request within the SLO: goodput = offered rate
                    goodput_ax.plot(levels, levels, ":", color="gray", label="offered rate")
            _plot_goodput(goodput_ax, x, summaries, endpoint.get("slo_capacity"), color, name)
        behind = [(p["level"], _f(p["summary"]["output_throughput"])) for p in points if p["client"]["behind"]]
        if behind:
            throughput_ax.plot(*zip(*behind), "x", color="red", markersize=12, label="client fell behind")
    for ax, ylabel, heading in (
        (throughput_ax, "tokens / s", "Throughput"),
        (ttft_ax, "ms", "Time to first token (percentiles)"),
        (tpot_ax, "ms", "Time per output token (percentiles)"),
    ):
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
        if len(levels) > 2 and levels[0] > 0 and levels[-1] / levels[0] >= 4:
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{level:g}" for level in levels])
    curve_ax.set_xlabel("output throughput (tokens / s)")
    curve_ax.set_ylabel("end-to-end latency (s)")
    curve_ax.set_title("Latency vs throughput (labels: load level)")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    if goodput_ax is not None:
        goodput_ax.set_ylabel("goodput (requests / s within the SLO)")
        goodput_ax.legend(fontsize=7, loc="lower right")
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_goodput(ax: Axes, x: list[float], summaries: list[dict[str, Any]], capacity: dict[str, Any] | None,
                  color: str, name: str) -> None:
    goodputs = [_f((s.get("goodput") or {}).get("requests_per_s")) for s in summaries]
    ax.plot(x, goodputs, "^-.", color=color, label=f"{name} goodput")
    if capacity and capacity["level"] is not None:
        ax.axvline(capacity["level"], color=color, linestyle=":", alpha=0.8,
                   label=f"{name} capacity at SLO: {capacity['level']:g} {capacity['unit']}")


def _ms(value: float | None) -> float:
    return float("nan") if value is None else value * 1e3


def _f(value: float | None) -> float:
    return float("nan") if value is None else value
