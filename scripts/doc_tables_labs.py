"""The labs' summary table in docs/labs.md: per lab, one headline prediction beside its measurement, read off the
lab's results file, and the measured / predicted ratio."""

from __future__ import annotations

from collections.abc import Iterator

from doc_table_format import Column, Table, ratio

LAB_ORDER = ("kv-capacity", "prefix-cache", "priority", "speculative", "static-batching", "interference",
             "router-policies", "queueing", "roofline", "quantization")


def _rows_by(document: dict, key: str) -> dict:
    return {row[key]: row for row in document["rows"]}


def _headline(name: str, document: dict) -> tuple[str, float, float]:
    """(what is predicted, the prediction, the measurement) of one lab's run."""
    rows = document["rows"]
    if name == "kv-capacity":
        return "prompts at once in the largest pool", rows[-1]["predicted_sequences"], rows[-1]["peak_sequences"]
    if name == "prefix-cache":
        on = _rows_by(document, "prefix_caching")[True]
        return "prefill time saved (x), predicted as tokens saved", on["token_ratio"], on["time_ratio"]
    if name == "priority":
        fcfs = _rows_by(document, "policy")["fcfs"]
        return "background requests done before an urgent first token (FCFS)", fcfs["predicted_pairs"], fcfs["pairs"]
    if name == "speculative":
        return (f"tokens per drafted step at k = {rows[-1]['k']}, from a", rows[-1]["calc_from_conditional"],
                rows[-1]["tokens_per_step"])
    if name == "static-batching":
        by = _rows_by(document, "batching")
        return ("steps saved by continuous batching (x), from the length distribution",
                by["static"]["napkin_steps"] / by["continuous"]["napkin_steps"],
                by["static"]["steps"] / by["continuous"]["steps"])
    if name == "interference":
        return (f"stall unchunked over a {rows[-1]['budget']}-token budget's (x), predicted in tokens",
                rows[0]["stall_tokens"] / rows[-1]["stall_tokens"], rows[0]["stall_ms"] / rows[-1]["stall_ms"])
    if name == "router-policies":
        aware = _rows_by(document, "policy")["cache_aware"]
        return "cache-aware routing's hit rate", aware["napkin_hit_rate"], aware["hit_rate"]
    if name == "queueing":
        row = _rows_by(document, "rho")[0.9]
        return "steps in the system at load 0.9 (M/M/1)", row["predicted_sojourn"], row["sojourn"]
    if name == "roofline":
        return "batch-1 decode step, ms (the bandwidth floor)", rows[0]["floor_ms"], rows[0]["step_ms"]
    if name == "quantization":
        int4 = _rows_by(document, "config")["int4"]
        return "int4 batch-1 decode, tokens/s (its bandwidth floor)", int4["calc_tokens_per_s"], int4["tokens_per_s"]
    raise KeyError(name)


def _figure(value: float) -> str:
    if value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def labs_summary_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    for name, document in zip(LAB_ORDER, loaded):
        what, predicted, measured = _headline(name, document)
        shown = ratio(measured / predicted) if predicted else "-"
        yield f"`{name}`", what, _figure(predicted), _figure(measured), shown


def labs_summary(folder: str) -> Table:
    """The table of the runs in benchmarks/results/labs/FOLDER ("": the built-in model's, in labs/ itself)."""
    prefix = f"labs/{folder}/" if folder else "labs/"
    return Table(tuple(f"{prefix}{name}.json" for name in LAB_ORDER),
                 (Column("lab"), Column("the prediction"), Column("predicted", True), Column("measured", True),
                  Column("measured / predicted", True)),
                 labs_summary_rows)
