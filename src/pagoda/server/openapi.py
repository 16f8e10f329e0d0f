"""The OpenAPI document, rewritten to say what the server does rather than what FastAPI assumes.

FastAPI documents a 422 for every route with a body; pagoda answers a bad body with 400 in OpenAI's error
shape, and also answers 401 (a key is configured), 413 (body over the limit), 429 (waiting queue full),
503 (loading or draining) and 504 (request deadline). Streaming routes answer `text/event-stream` when the
body asks for `stream`; /metrics is Prometheus text; /health has no body. Generated clients and schema
fuzzers read this document, so it must agree with the server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA_NAME = "OpenAIErrorResponse"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}
_ERROR_TEXT = {
    400: "The request is invalid (the message names the field).",
    401: "An API key is configured and the request has none or a wrong one.",
    404: "The model named is not served.",
    413: "The request body is over --max-request-body-bytes.",
    429: "The waiting queue is full; retry after the Retry-After header's seconds.",
    503: "The model is loading or the server is draining.",
    504: "The request passed its deadline (--request-timeout) and was aborted.",
}
# Which errors each route can answer, beyond 401 (every route but the open ones, when a key is configured).
_ROUTE_ERRORS = {
    "/v1/completions": (400, 404, 413, 429, 503, 504),
    "/v1/chat/completions": (400, 404, 413, 429, 503, 504),
    "/v1/responses": (400, 404, 413, 429, 503, 504),
    "/v1/responses/{response_id}": (404, 503),
    "/v1/embeddings": (400, 404, 413, 429, 503, 504),
    "/tokenize": (400, 404, 413, 503),
    "/detokenize": (400, 404, 413, 503),
    "/v1/models": (503,),
    "/reset_prefix_cache": (503,),
}
_OPEN_ROUTES = ("/health", "/version")  # /metrics too, unless --guard-metrics: its 401 is documented
_STREAMING_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def install_openapi(app: FastAPI) -> None:
    """Serve the rewritten document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = rewrite(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema


def rewrite(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas[ERROR_SCHEMA_NAME] = ERROR_SCHEMA
    for path, operations in document.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            codes = _ROUTE_ERRORS.get(path, ()) + (() if path in _OPEN_ROUTES else (401,))
            for code in sorted(codes):
                responses[str(code)] = _error_response(code)
            if path in _STREAMING_ROUTES:
                # Untyped: tools read a stream's schema as each event's, and the events are not all alike.
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {"description": (
                    "Server-sent events: a JSON chunk each, then data: [DONE] (/v1/responses: typed events, the "
                    "last response.completed)")}}
    _plain_responses(document)
    return document


def _error_response(code: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _ERROR_TEXT[code],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}}},
    }
    if code == 429:
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return response


def _plain_responses(document: dict[str, Any]) -> None:
    paths = document.get("paths", {})
    if "/health" in paths:
        paths["/health"]["get"]["responses"] = {
            "200": {"description": "Ready to serve."},
            "503": {"description": _ERROR_TEXT[503]},
        }
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"]["200"] = {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
