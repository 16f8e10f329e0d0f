"""Console tables, warnings and the JSON document of a benchmark."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

from pagoda.version import __version__

ROW_COLUMNS = ("endpoint", "load", "ok", "err", "req/s", "out tok/s", "total tok/s", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "ITL p50", "E2E p50", "goodput")
STATS = ("mean", "p50", "p90", "p95", "p99")
SPEC_COLUMNS = ("endpoint", "load", "drafts", "draft tok", "accepted", "accept rate", "mean accept len",
                "per-position accept rate")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def level_row(endpoint_name: str, point: dict[str, Any]) -> list[str]:
    s = point["summary"]
    goodput = s.get("goodput")
    good = "-" if not goodput else f"{_num(goodput['requests_per_s'])}/s ({goodput['fraction']:.0%})"
    flag = " !" if point["client"]["behind"] else ""
    return [endpoint_name, point["label"] + flag, str(s["num_ok"]), str(s["num_errors"]),
            _num(s["request_throughput"]), _num(s["output_throughput"]), _num(s["total_throughput"]),
            _ms(s["ttft"]["p50"]), _ms(s["ttft"]["p99"]), _ms(s["tpot"]["p50"]), _ms(s["tpot"]["p99"]),
            _ms(s["itl"]["p50"]), _num(s["e2e"]["p50"]), good]


def format_table(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).rjust(width) for cell, width in zip(line, widths)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def results_table(endpoints: list[dict[str, Any]]) -> str:
    rows = [level_row(e["name"], point) for e in endpoints for point in e["levels"]]
    legend = "times in ms except E2E (s); '!' = the client fell behind at that level (see warnings)"
    return format_table(ROW_COLUMNS, rows) + "\n" + legend


def detail_table(point: dict[str, Any]) -> str:
    """mean / p50 / p90 / p95 / p99 of TTFT, TPOT, ITL and E2E (ms) of one level."""
    s = point["summary"]
    rows = [[name.upper(), str(s[name]["count"]), *(_ms(s[name][stat]) for stat in STATS)]
            for name in ("ttft", "tpot", "itl", "e2e")]
    return format_table(("metric (ms)", "n", *STATS), rows)


CLASS_COLUMNS = ("class", "n", "ok", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50",
                 "E2E p99", "out tok/s", "goodput")
CLASS_DIMENSIONS = {"priority": "priority", "tenant": "tenant", "prompt_len": "prompt tokens"}


def class_tables(point: dict[str, Any]) -> list[str]:
    """Latency per request class of one level (bench/classes.py), for each dimension with several classes."""
    tables = []
    for dimension, classes in point["summary"].get("by_class", {}).items():
        if len(classes) < 2:
            continue
        rows = []
        for label, c in classes.items():
            goodput = c.get("goodput")
            good = "-" if not goodput else (f"{_num(goodput['requests_per_s'])}/s, "
                                            f"{_num(goodput['output_tokens_per_s'])} tok/s")
            rows.append([f"{CLASS_DIMENSIONS.get(dimension, dimension)} {label}", str(c["num_requests"]),
                         str(c["num_ok"]), _ms(c["ttft"]["p50"]), _ms(c["ttft"]["p90"]), _ms(c["ttft"]["p99"]),
                         _ms(c["tpot"]["p50"]), _ms(c["tpot"]["p99"]), _num(c["e2e"]["p50"]), _num(c["e2e"]["p99"]),
                         _num(c["output_throughput"]), good])
        tables.append(format_table(CLASS_COLUMNS, rows))
    return tables


def spec_row(endpoint_name: str, point: dict[str, Any]) -> list[str]:
    spec = point["speculative"]
    rate = spec["acceptance_rate"]
    positions = " ".join(f"{value:.2f}" for value in spec["per_position_acceptance_rate"]) or "-"
    return [endpoint_name, point["label"], str(spec["num_drafts"]), str(spec["num_draft_tokens"]),
            str(spec["num_accepted_tokens"]), "-" if rate is None else f"{rate:.1%}",
            f"{spec['mean_acceptance_length']:.2f}", positions]


def spec_table(endpoints: list[dict[str, Any]]) -> str | None:
    """Speculative decoding per level, from the server's counters; None when no level has any (a server
    that does not speculate, or exports no /metrics)."""
    rows = [spec_row(e["name"], point) for e in endpoints for point in e["levels"] if point.get("speculative")]
    if not rows:
        return None
    legend = ("speculative decoding (server counters over each level): accept rate = accepted / draft tokens, "
              "mean accept len = 1 + accepted / drafts, per position = accepted there / drafts")
    return format_table(SPEC_COLUMNS, rows) + "\n" + legend


# How far the client's count of output tokens may drift from the server's before a note says so.
TOKEN_RATIO_TOLERANCE = 0.1


def warnings_of(endpoint: dict[str, Any], point: dict[str, Any]) -> list[str]:
    """What a reader must know before trusting a level's numbers."""
    s, client, where = point["summary"], point["client"], f"{endpoint['name']} {point['label']}"
    notes = []
    if client["behind"]:
        notes += [f"CLIENT FELL BEHIND ({where}): {reason}; these numbers include the client's own delay"
                  for reason in client["reasons"]]
    notes += [f"{where}: {warning}" for warning in client["warnings"]]
    if s["errors"]:
        errors = ", ".join(f"{kind} x{count}" for kind, count in sorted(s["errors"].items()))
        notes.append(f"{where}: {s['num_errors']} of {s['num_requests']} requests failed: {errors}")
    tokens = s["tokens"]
    if tokens["short_outputs"]:
        notes.append(f"{where}: {tokens['short_outputs']} of {s['num_ok']} requests returned fewer tokens than "
                     "asked (max_tokens); use --ignore-eos to force output lengths")
    if tokens["usage_missing"]:
        notes.append(f"{where}: {tokens['usage_missing']} responses had no usage; token counts there come from "
                     "the client tokenizer")
    cached = tokens.get("cached_prompt_tokens") or 0
    if cached and s["input_tokens"]:
        notes.append(f"{where}: {cached} of {s['input_tokens']} prompt tokens ({cached / s['input_tokens']:.0%}) were "
                     "prefix-cache hits (usage cached_tokens): TTFT is not a cold prefill there. Unless the workload "
                     "shares prefixes on purpose, an earlier run with the same --seed left them in the cache: "
                     "use another --seed or --reset-prefix-cache")
    if tokens["prompt_mismatches"]:
        notes.append(f"{where}: usage.prompt_tokens differs from the client's count in "
                     f"{tokens['prompt_mismatches']} of {tokens['prompt_checked']} requests")
    if point["warmup"].get("errors"):
        notes.append(f"{where}: {point['warmup']['errors']} of {point['warmup']['requests']} warm-up requests failed")
    return notes


def token_count_note(endpoint: dict[str, Any]) -> str | None:
    """Once per endpoint, not per level: how far re-encoding the output drifts is the tokenizer's doing."""
    ratios = [ratio for point in endpoint["levels"]
              if (ratio := point["summary"]["tokens"]["output_client_over_server"]) is not None
              and abs(ratio - 1) > TOKEN_RATIO_TOLERANCE]
    if not ratios:
        return None
    low, high = f"{min(ratios):.2f}x", f"{max(ratios):.2f}x"
    span = low if low == high else f"{low} to {high}"
    levels = f" at {len(ratios)} of {len(endpoint['levels'])} levels" if len(endpoint["levels"]) > 1 else ""
    return (f"{endpoint['name']}: the client tokenizer counts {span} the server's output tokens{levels} "
            "(re-encoding generated text is not exact; the server's usage is what metrics use)")


def capacity_line(endpoint: dict[str, Any]) -> str:
    """`capacity at SLO ...: 4 req/s` (the sweep's highest level where enough requests met the SLO)."""
    capacity = endpoint["slo_capacity"]
    bounds = ", ".join(f"{name} <= {_ms(value)} ms" for name, value in capacity["slo_s"].items())
    if capacity.get("percentile") is not None:
        share = f"p{capacity['percentile']} " + ", ".join(
            f"{name} <= {_ms(value)} ms" for name, value in capacity["slo_s"].items())
    else:
        share = f">= {capacity['min_fraction']:.0%} of requests within {bounds}"
    if capacity["level"] is None:
        return f"{endpoint['name']}: capacity at the SLO ({share}): none; even the lowest level missed it"
    return (f"{endpoint['name']}: capacity at the SLO ({share}): {capacity['level']:g} {capacity['unit']} "
            f"(goodput there {_num(capacity['goodput_requests_per_s'])} req/s)")


def render(endpoints: list[dict[str, Any]]) -> str:
    parts = [results_table(endpoints)]
    single = [(e, p) for e in endpoints for p in e["levels"]]
    if len(single) == 1:
        parts.append(detail_table(single[0][1]))
        parts += class_tables(single[0][1])
    speculative = spec_table(endpoints)
    if speculative:
        parts.append(speculative)
    notes = [note for e, p in single for note in warnings_of(e, p)]
    notes += [note for e in endpoints if (note := token_count_note(e))]
    notes += [f"{e['name']}: sweep stopped: {e['stop_reason']}" for e in endpoints if e.get("stop_reason")]
    notes += [f"{e['name']} {p['label']}: the server's step timeline is in {p['profile'].get('trace_file')}"
              if p["profile"] else f"{e['name']} {p['label']}: no profile: the server has no /start_profile "
                                   "(pagoda serve --profile-dir)"
              for e in endpoints for p in e["levels"] if "profile" in p]
    capacities = [capacity_line(e) for e in endpoints if e.get("slo_capacity") and len(e["levels"]) > 1]
    if capacities:
        parts.append("\n".join(capacities))
    if notes:
        parts.append("\n".join(f"WARNING: {note}" if "CLIENT FELL BEHIND" in note else f"note: {note}"
                               for note in notes))
    return "\n\n".join(parts) + "\n"


def environment() -> dict[str, Any]:
    """Where the client ran (the server may be elsewhere)."""
    import httpx

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"pagoda": __version__, "python": platform.python_version(), "httpx": httpx.__version__,
            "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "loadavg_1_5_15": list(load) if load else None}


def document(command: str, config: dict[str, Any], endpoints: list[dict[str, Any]], note: str | None, started: str,
             environment_before: dict[str, Any]) -> dict[str, Any]:
    after = environment()
    return {"pagoda_bench": 1, "command": command, "started": started, "note": note, "config": config,
            "environment": {**environment_before, "loadavg_after": after["loadavg_1_5_15"]},
            "endpoints": endpoints}


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _finite(value: object) -> object:
    """JSON has no inf or nan: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def print_level(endpoint_name: str, point: dict[str, Any]) -> None:
    """One line per finished level, as the run goes (stderr: stdout gets the final table)."""
    s = point["summary"]
    behind = " (CLIENT FELL BEHIND)" if point["client"]["behind"] else ""
    spec = point.get("speculative")
    accepted = f", mean acceptance length {spec['mean_acceptance_length']:.2f}" if spec else ""
    sys.stderr.write(f"{endpoint_name} {point['label']}: {s['num_ok']} ok, {s['num_errors']} failed, "
                     f"{_num(s['output_throughput'])} out tok/s, TTFT p50 {_ms(s['ttft']['p50'])} ms, "
                     f"TPOT p50 {_ms(s['tpot']['p50'])} ms{accepted}{behind}\n")
    sys.stderr.flush()
