"""How scripts/doc_tables.py describes a table (its results files, its columns, the function making its rows) and
formats its cells."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS = REPOSITORY / "benchmarks" / "results"


@dataclass(frozen=True)
class Column:
    heading: str
    numeric: bool = False  # right-aligned


@dataclass(frozen=True)
class Table:
    files: tuple[str, ...]  # under benchmarks/results/
    columns: tuple[Column, ...]
    rows: Callable[[list[dict]], Iterator[tuple[str, ...]]]  # the loaded files -> the body's cells


def seconds(value: float) -> str:
    """0.53, 2.1, 12.7: two decimals below a second, one above."""
    return f"{value:.2f}" if value < 1 else f"{value:.1f}"


def two_places(value: float) -> str:
    """1.71, 22.8: two decimals below 10, one above."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio(value: float) -> str:
    return f"{value:.2f}×"


def per_second(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def joined(values: list[str]) -> str:
    """"a / b" for a value per k or batch size; one value when they agree."""
    return values[0] if len(set(values)) == 1 else " / ".join(values)
