"""vLLM's profiling routes: `POST /start_profile` begins recording the engine's steps, `POST /stop_profile`
writes the timeline since then to a Trace Event Format file under --profile-dir and answers its path (open it
in Perfetto or chrome://tracing). Without --profile-dir neither route exists, as in vLLM without its
profiler directory. Guarded like the API.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

if TYPE_CHECKING:
    from pagoda.server.state import ServerState


def mount_profile(app: FastAPI, state: ServerState, directory: Path) -> None:
    async def start_profile() -> dict[str, Any]:
        state.require_ready().engine.start_trace()
        return {}

    async def stop_profile() -> dict[str, Any]:
        document = state.require_ready().engine.stop_trace()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"pagoda-trace-{time.time_ns()}.json"
        path.write_text(json.dumps(document), encoding="utf-8")
        return {"trace_file": str(path), "num_events": len(document["traceEvents"])}

    app.add_api_route("/start_profile", start_profile, methods=["POST"])
    app.add_api_route("/stop_profile", stop_profile, methods=["POST"])
