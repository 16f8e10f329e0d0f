"""What a lab returns, and how it is shown: a table on the terminal, a JSON file and one plot."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Cell = float | int | str | bool | None


@dataclass
class LabResult:
    lab: str
    question: str
    columns: list[tuple[str, str]]  # (row key, heading)
    rows: list[dict[str, Cell]]
    lesson: str  # what the numbers show, in one or two sentences
    lesson_holds: bool  # the lesson checked on counted quantities
    settings: dict[str, Any] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)  # per-step traces, for the plot

    def column(self, key: str) -> list[float]:
        """A numeric column, for plotting."""
        values = [float(v) for row in self.rows if isinstance(v := row.get(key), (int, float))]
        assert len(values) == len(self.rows), f"{key} is not numeric in every row"
        return values

    def table(self) -> str:
        headings = [heading for _, heading in self.columns]
        cells = [[_cell(row.get(key)) for key, _ in self.columns] for row in self.rows]
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headings)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(headings, widths))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)


def _cell(value: Cell) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "NO")
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else value


def write_json(result: LabResult, path: Path) -> None:
    path.write_text(json.dumps(asdict(result), indent=1) + "\n")


def write_plot(result: LabResult, draw: Callable[[LabResult, Axes], None], path: Path) -> None:
    # matplotlib's font-cache message goes through logging, which `pagoda`'s INFO handler would print.
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    draw(result, axes)
    axes.set_title(result.question, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
