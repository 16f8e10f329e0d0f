"""The calculator page's routes: its presets and defaults, and a report for the page's fields, computed by
`pagoda calc`'s own Python (pagoda.calc.page). Guarded like the API: a report is work done for a caller.

"served" is the model this server runs (its config.json, read once); "this-machine" is this host, measured once
when first asked (off the event loop: the copy and matmuls take a moment) and kept.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from pagoda.calc.page import CalcFieldError, calculate, presets, wants_this_machine
from pagoda.calc.shapes import GpuSpec
from pagoda.wire import OpenAIError

if TYPE_CHECKING:
    from pagoda.server.state import ServerState

PRESETS_PATH = "/calc/presets"
REPORT_PATH = "/calc/report"
MAX_CONFIG_KEYS = 512  # a pasted config.json: a model's has a few dozen


class CalcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fields: dict[str, str | int | float | None] = {}
    config: dict[str, Any] | None = None  # a pasted config.json


class MachineMeasurement:
    """This host's bandwidth and matmul rate, measured at most once."""

    def __init__(self) -> None:
        self._spec: GpuSpec | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> GpuSpec:
        async with self._lock:
            if self._spec is None:
                from pagoda.calc.measure import measure_this_machine

                self._spec = await asyncio.to_thread(measure_this_machine)
            return self._spec


def mount_calc(app: FastAPI, state: ServerState) -> None:
    measurement = MachineMeasurement()
    served: dict[str, dict[str, Any] | None] = {}

    def served_config() -> dict[str, Any] | None:
        if "config" not in served:
            loaded = state.require_ready()
            path = Path(loaded.engine.description.model) / "config.json"
            served["config"] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        return served["config"]

    async def calc_presets() -> dict[str, Any]:
        return presets()

    async def calc_report(body: CalcRequest) -> dict[str, Any]:
        if body.config is not None and len(body.config) > MAX_CONFIG_KEYS:
            raise OpenAIError(400, f"config: at most {MAX_CONFIG_KEYS} keys", "config")
        measured = await measurement.get() if wants_this_machine(body.fields) else None
        config = served_config() if body.fields.get("model") == "served" and body.config is None else None
        try:
            return await asyncio.to_thread(calculate, body.fields, served_config=config, config=body.config,
                                           measured=measured)
        except CalcFieldError as error:
            raise OpenAIError(400, str(error), error.field) from error

    app.add_api_route(PRESETS_PATH, calc_presets, methods=["GET"], include_in_schema=False)
    app.add_api_route(REPORT_PATH, calc_report, methods=["POST"], include_in_schema=False)
