"""How the command line writes values: byte counts with K, M, G suffixes, JSON objects, and a default as a
flag's help shows it. Imports nothing of pagoda's: every command's flags use it."""

from __future__ import annotations

import argparse
import json
from typing import Any

_BYTE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2G' -> 2 GiB, '512k' -> 512 KiB, '1.5MiB', '4096'."""
    units = {unit.lower(): size for unit, size in _BYTE_UNITS.items()}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_bytes(count: int) -> str:
    """What parse_bytes reads back: the largest unit that divides the count (2 GiB -> '2G')."""
    for unit, size in sorted(_BYTE_UNITS.items(), key=lambda item: -item[1]):
        if count and count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def show_default(value: object) -> str:
    """A default as help prints it: 200.0 -> '200', True -> 'on', None -> 'none'."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)
