"""The report's shape (sections of rows, one batch table) and its two renderings: a text table and JSON.

Values are kept in SI base units (bytes, seconds, flop/s); units are applied only when printing, and
JSON carries the raw numbers so nothing is lost to rounding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Value = float | int | str | bool | None


@dataclass(frozen=True)
class Row:
    key: str  # the JSON key; names carry their unit (…_bytes, …_s, …_per_s)
    label: str
    value: Value
    unit: str = ""  # how to print: bytes, s, flop, flop/s, B/s, tok/s, flop/byte, $, x, %, or ""
    note: str = ""


@dataclass
class Section:
    key: str
    title: str
    rows: list[Row] = field(default_factory=list)

    def add(self, key: str, label: str, value: Value, unit: str = "", note: str = "") -> None:
        self.rows.append(Row(key, label, value, unit, note))


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    unit: str = ""


@dataclass
class Table:
    key: str
    title: str
    columns: list[Column]
    records: list[dict[str, Value]] = field(default_factory=list)


@dataclass
class Report:
    parts: list[Section | Table]
    warnings: list[str]
    fits: bool


# --- number formatting --------------------------------------------------------------------------


def _sig(x: float, digits: int = 4) -> str:
    """About `digits` significant figures, thousands separated, no exponent for everyday sizes."""
    if x == 0 or not math.isfinite(x):
        return str(x)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def _scaled(x: float, unit: str, steps: Sequence[tuple[float, str]]) -> str:
    for scale, prefix in steps:
        if abs(x) >= scale:
            return f"{_sig(x / scale)} {prefix}{unit}"
    return f"{_sig(x)} {unit}"


_SI = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
_SI_BYTES = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
_BINARY = [(2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")]


def format_bytes(n: float) -> str:
    """Decimal and binary side by side (GB = 10^9, GiB = 2^30); exact bytes too for small counts."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1000:
        return f"{_sig(n)} B"
    text = f"{_scaled(n, 'B', _SI_BYTES)} = {_scaled(n, 'B', _BINARY)}"
    if n < 1e7 and float(n).is_integer():
        text = f"{int(n):,} B = {text}"
    return text


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{_sig(s)} s"
    if s >= 1e-3:
        return f"{_sig(s * 1e3)} ms"
    return f"{_sig(s * 1e6)} µs"


def format_value(value: Value, unit: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, str):
        return value
    if unit == "bytes":
        return format_bytes(value)
    if unit == "s":
        return format_seconds(value)
    if unit in ("flop", "flop/s"):
        return _scaled(value, unit.upper().replace("FLOP/S", "FLOP/s"), _SI)
    if unit == "B/s":
        return _scaled(value, "B/s", _SI_BYTES)
    if unit == "$":
        return f"${value:,.2f}" if value >= 1 else f"${_sig(value, 3)}"
    if unit == "x":
        return f"{_sig(value)}x"
    if unit == "%":
        return f"{_sig(value * 100, 3)}%"
    if isinstance(value, int):
        return f"{value:,}" + (f" {unit}" if unit else "")
    return _sig(value) + (f" {unit}" if unit else "")


# --- renderings ---------------------------------------------------------------------------------


def _render_section(section: Section) -> list[str]:
    width = max(len(row.label) for row in section.rows)
    lines = [section.title, "-" * len(section.title)]
    for row in section.rows:
        text = f"  {row.label:<{width}}  {format_value(row.value, row.unit)}"
        lines.append(f"{text}   ({row.note})" if row.note else text)
    return lines


def _render_table(table: Table) -> list[str]:
    header = [column.label for column in table.columns]
    cells = [[format_value(r[c.key], c.unit) for c in table.columns] for r in table.records]
    widths = [max(len(text) for text in column) for column in zip(header, *cells)]
    lines = [table.title, "-" * len(table.title)]
    for row in [header, *cells]:
        lines.append("  " + "  ".join(text.rjust(width) for text, width in zip(row, widths)))
    return lines


def render_text(report: Report) -> str:
    lines: list[str] = []
    for warning in report.warnings:
        lines.append(f"!! {warning}")
    for part in report.parts:
        if lines:
            lines.append("")
        lines.extend(_render_section(part) if isinstance(part, Section) else _render_table(part))
    return "\n".join(lines) + "\n"


def to_dict(report: Report) -> dict[str, Any]:
    out: dict[str, Any] = {"fits": report.fits, "warnings": report.warnings}
    for part in report.parts:
        if isinstance(part, Section):
            out[part.key] = {row.key: row.value for row in part.rows}
        else:
            out[part.key] = part.records
    return out


def render_json(report: Report) -> str:
    return json.dumps(to_dict(report), indent=2) + "\n"
