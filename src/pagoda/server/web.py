"""The web UI: a chat page at /, a live dashboard at /dashboard, the calculator at /calc, and their JSON.

The pages are static files shipped in the package (pagoda/server/web/), read once when the app is built and
served from memory under fixed paths: no CDN, no build step, no path taken from the request. They hold no
data, so they are served without an API key; the page asks for the key and sends it with its API calls,
and the stats route (and the model's introduction) is guarded like the API.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import Response

from pagoda.server.calc_page import mount_calc

if TYPE_CHECKING:
    from pagoda.engine.api import KVConnectorStats
    from pagoda.server.state import ServerState

WEB_DIR = Path(__file__).resolve().parent / "web"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html", "/calc": "calc.html"}
ASSETS_PATH = "/web"  # every other file of WEB_DIR is served at /web/<name>
STATS_PATH = "/dashboard/stats"
INTRO_PATH = "/chat/intro"  # what the chat page says about the model before the first question
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Model text is only ever inserted as text; this policy is the second line: no inline script, nothing
# fetched from anywhere but this server, no framing.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a pagoda upgrade must not leave an old script cached
}


def static_files(directory: Path = WEB_DIR) -> dict[str, Path]:
    """URL path -> file, for every file the UI serves."""
    files = {path: directory / name for path, name in PAGES.items()}
    pages = set(PAGES.values())
    for file in sorted(directory.iterdir()):
        if file.is_file() and file.name not in pages and file.suffix in CONTENT_TYPES:
            files[f"{ASSETS_PATH}/{file.name}"] = file
    return files


def mount_web_ui(app: FastAPI, state: ServerState) -> frozenset[str]:
    """Adds the pages, their assets and the stats route; returns the paths served without a key."""
    files = static_files()
    for path, file in files.items():
        app.add_api_route(path, _static_endpoint(file), methods=["GET", "HEAD"], include_in_schema=False)

    async def dashboard_stats() -> dict[str, Any]:
        return stats_body(state)

    async def model_intro() -> dict[str, Any]:
        return intro_body(state)

    app.add_api_route(STATS_PATH, dashboard_stats, methods=["GET"], include_in_schema=False)
    app.add_api_route(INTRO_PATH, model_intro, methods=["GET"], include_in_schema=False)
    mount_calc(app, state)
    return frozenset(files)


def intro_body(state: ServerState) -> dict[str, Any]:
    """For the built-in model, what it can do and questions to try; for any other model, nothing to say."""
    from pagoda.demo import DEMO_EXAMPLES, DEMO_INTRO

    if not state.builtin_model:
        return {"intro": None, "examples": []}
    return {"intro": DEMO_INTRO, "examples": list(DEMO_EXAMPLES)}


def _static_endpoint(file: Path) -> Callable[[], Coroutine[Any, Any, Response]]:
    body, media_type = file.read_bytes(), CONTENT_TYPES[file.suffix]

    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    return serve_file


def stats_body(state: ServerState) -> dict[str, Any]:
    """The dashboard's poll: the engine's gauges and counters now, and the last minutes of latencies and
    tokens (pagoda.server.activity). Reads snapshots only: cheap on the event loop."""
    loaded = state.require_ready()
    stats = loaded.engine.stats
    return {
        "model": state.model_name,
        "time": time.time(),
        "max_model_len": loaded.engine.max_model_len,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "recent": loaded.metrics.recent.snapshot(),
        "kv_tiers": kv_tiers_body(stats.kv_connector),
    }


def kv_tiers_body(stats: KVConnectorStats | None) -> dict[str, Any] | None:
    """The offload tiers' counters since start-up (docs/kv-offload.md), or None without a KV connector."""
    if stats is None:
        return None
    return {
        "queries": stats.external_prefix_cache_queries,
        "hits": stats.external_prefix_cache_hits,
        "failed_loads": stats.failed_loads,
        "tiers": [dataclasses.asdict(tier) for tier in stats.tiers],
    }
