"""The server's error answers: every failure in OpenAI's error shape, a validation error naming the field at
fault, and an unexpected exception as an id to quote (the log has the details under it), never its text."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.wire import OpenAIError, random_id
from pagoda.wire.base import error_message

logger = logging.getLogger("pagoda.server.api")  # the routes' logger: where these lines always were
MAX_ERRORS_SHOWN = 5  # of a body's validation errors, in the 400's message


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if not errors or errors[0].get("type") == "json_invalid":
            return _error_response(OpenAIError(400, "the request body is not valid JSON"))
        fields = [str(e["loc"][1]) if len(e.get("loc", ())) > 1 else "" for e in errors]  # the top-level field
        lines = list(dict.fromkeys(f"{field}: {error_message(e)}" for field, e in zip(fields, errors)))
        message = "; ".join(lines[:MAX_ERRORS_SHOWN])
        if len(lines) > MAX_ERRORS_SHOWN:
            message += f"; and {len(lines) - MAX_ERRORS_SHOWN} more"
        return _error_response(OpenAIError(400, message, fields[0] or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers) if error.headers else None
        return _error_response(OpenAIError(error.status_code, str(error.detail), getattr(error, "param", None),
                                           headers=headers))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, error: Exception) -> JSONResponse:
        """Never the exception's text (it may show paths, code or other requests' data): an id to quote,
        under which the log has the details."""
        request_id = random_id("req")
        logger.error("internal error, request id %s", request_id, exc_info=error)
        return _error_response(OpenAIError(500, f"internal error (request id {request_id})",
                                           headers={"X-Request-Id": request_id}))
