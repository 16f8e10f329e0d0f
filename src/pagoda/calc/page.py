"""The calculator as the web page asks for it: the CLI's own flags in, the CLI's own figures out.

A page's fields are the `pagoda calc` flags by their names (`batch`, `seq_len`, `kv_dtype`, ...), parsed by
the CLI's parser, so the page and the CLI cannot disagree on a default or a rule; the answer carries the report
formatted as the text rendering prints it (what the page shows), as JSON (raw numbers), and the roofline
chart's points, computed here: the page draws, it never computes a figure. A model is a preset, a parameter
count, a pasted config.json, or the model the server runs: never a path, which would read the server's files.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from pagoda.calc.cli import add_arguments, gpu_from_args, inputs_from_args
from pagoda.calc.deployment import CalcInputs, decode_point, derive, table_batches
from pagoda.calc.presets import GPU_PRESETS, MODEL_CONFIGS, THIS_MACHINE, resolve_model
from pagoda.calc.render import Report, Section, format_value, render_text, to_dict
from pagoda.calc.report import build_report
from pagoda.calc.shapes import GpuSpec, ModelShape, params_only, parse_param_count, shape_from_hf_config

SERVED_MODEL = "served"  # the `model` that names the checkpoint the server runs
# The flags a page may set, as the CLI's argparse names them; output switches are not among them.
FIELDS = ("model", "gpu", "tflops", "tbps", "gpu_mem_gb", "interconnect_gbps", "interconnect_latency_us",
          "num_gpus", "dtype", "kv_dtype", "mem_util", "seq_len", "batch", "prompt_len", "achieved_tflops",
          "price_per_hour", "tokens_per_s", "spec_alpha", "spec_k", "spec_draft_cost", "prefix_len", "block_size",
          "token_budget", "running_decodes")
ROOFLINE_POINTS = 64  # of the attainable-compute curve, log-spaced over four decades around the ridge


class CalcFieldError(ValueError):
    """A field the calculator refuses, named as the page names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Parser(argparse.ArgumentParser):
    """The CLI's parser, raising instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CalcFieldError(_flag_in(message) or "fields", message)


def _flag_in(message: str) -> str | None:
    for word in message.replace("/", " ").split():
        if word.startswith("--"):
            return word[2:].rstrip(":,").replace("-", "_")
    return None


def _parser() -> _Parser:
    parser = _Parser(prog="pagoda calc", add_help=False)
    add_arguments(parser)
    return parser


def presets() -> dict[str, Any]:
    """What the page offers in its lists, and the CLI's default for every field."""
    defaults = vars(_parser().parse_args([]))
    return {"models": [*MODEL_CONFIGS, SERVED_MODEL], "gpus": [*GPU_PRESETS, THIS_MACHINE[0]],
            "defaults": {name: defaults[name] for name in FIELDS}}


def wants_this_machine(fields: dict[str, Any]) -> bool:
    gpu = fields.get("gpu")
    return isinstance(gpu, str) and gpu.strip().lower() in THIS_MACHINE


def calculate(fields: dict[str, Any], *, served_config: dict[str, Any] | None = None,
              config: dict[str, Any] | None = None, measured: GpuSpec | None = None) -> dict[str, Any]:
    """The report for the page's fields. served_config: the served model's config.json (model "served");
    config: a config.json the user pasted (the model field is then only its name); measured: this machine's
    figures, for gpu "this-machine" (the caller measures, once)."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise CalcFieldError(unknown[0], f"{unknown[0]} is not a calculator field ({', '.join(FIELDS)})")
    argv: list[str] = []
    for name in FIELDS:
        value = fields.get(name)
        if name != "model" and value is not None and value != "":
            argv += [f"--{name.replace('_', '-')}", str(value)]
    args = _parser().parse_args(argv)
    model = _model(str(fields.get("model") or args.model), served_config, config)
    args.model = "1B"  # a stand-in the CLI resolves without touching a file; replaced by `model` below
    this_machine = wants_this_machine(fields)
    if this_machine:
        if measured is None:
            raise CalcFieldError("gpu", "this machine has not been measured")
        args.gpu = None  # the CLI would measure; the caller has: its figures, unless a field overrides them
        args.tflops = measured.peak_tflops if args.tflops is None else args.tflops
        args.tbps = measured.bandwidth_tbps if args.tbps is None else args.tbps
        args.gpu_mem_gb = measured.memory_gb if args.gpu_mem_gb is None else args.gpu_mem_gb
    try:
        gpu_from_args(args)
    except ValueError as error:
        raise CalcFieldError("gpu", str(error)) from error
    try:
        inputs = replace(inputs_from_args(args), model=model)
        if this_machine and measured is not None:
            inputs = replace(inputs, gpu=replace(inputs.gpu, name=measured.name, source=measured.source))
        report = build_report(inputs)
    except ValueError as error:
        raise CalcFieldError(_flag_in(str(error)) or "fields", str(error)) from error
    return {"text": render_text(report), "json": to_dict(report), "parts": display_parts(report),
            "roofline": roofline(inputs)}


def _model(name: str, served_config: dict[str, Any] | None, config: dict[str, Any] | None) -> ModelShape:
    if config is not None:
        return _config_shape(config, name if name != SERVED_MODEL else "pasted config.json", "config")
    if name == SERVED_MODEL:
        if served_config is None:
            raise CalcFieldError("model", "the server runs no model with a config.json")
        return _config_shape(served_config, "the served model", "model")
    if name.strip().lower().replace("_", "-") in MODEL_CONFIGS:
        return resolve_model(name)
    count = parse_param_count(name)
    if count is not None:
        return params_only(name, count)
    raise CalcFieldError("model", f"{name!r} is not a preset ({', '.join(MODEL_CONFIGS)}), a parameter count "
                                  f"like 70B, or {SERVED_MODEL!r}")


def _config_shape(config: dict[str, Any], name: str, field: str) -> ModelShape:
    try:
        return shape_from_hf_config(config, name)
    except (KeyError, TypeError, ValueError) as error:
        raise CalcFieldError(field, f"not a usable config.json: {error}") from error


def display_parts(report: Report) -> list[dict[str, Any]]:
    """The report as the page shows it: every figure formatted as the CLI's text prints it."""
    parts: list[dict[str, Any]] = []
    for part in report.parts:
        if isinstance(part, Section):
            parts.append({"key": part.key, "title": part.title, "rows": [
                {"key": row.key, "label": row.label, "text": format_value(row.value, row.unit), "note": row.note}
                for row in part.rows]})
        else:
            parts.append({"key": part.key, "title": part.title, "columns": [c.label for c in part.columns],
                          "rows": [[format_value(record[c.key], c.unit) for c in part.columns]
                                   for record in part.records]})
    return parts


def roofline(inputs: CalcInputs) -> dict[str, Any]:
    """One GPU's roofline: attainable flop/s against arithmetic intensity (flop/byte), and where decode sits
    at each batch of the CLI's batch table."""
    gpu, deployment = inputs.gpu, derive(inputs)
    ridge = gpu.peak_flops / gpu.bandwidth
    low, high = ridge / 1000, ridge * 10

    def attainable(intensity: float) -> float:
        return min(gpu.peak_flops, gpu.bandwidth * intensity)

    curve = [low * (high / low) ** (i / (ROOFLINE_POINTS - 1)) for i in range(ROOFLINE_POINTS)]
    points = [decode_point(deployment, batch) for batch in table_batches(deployment)]
    return {"ridge": ridge, "curve": [[x, attainable(x)] for x in curve],
            "decode": [{"batch": p.batch, "intensity": p.intensity, "flop_per_s": attainable(p.intensity),
                        "chosen": p.batch == inputs.batch} for p in points if p.intensity > 0]}
