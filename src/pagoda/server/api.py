"""The FastAPI app: OpenAI routes, health, metrics, tokenizer routes. Never touches the scheduler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.engine import RequestRejected
from pagoda.engine.output import Tokenizer
from pagoda.model.tokenizer import ChatTemplateError, encode_chat
from pagoda.sampling import SamplingParams
from pagoda.server.generation import Admission, Generation
from pagoda.server.metrics import ServerMetrics
from pagoda.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    now,
    random_id,
)
from pagoda.server.tools import TOOL_CALL_PARSERS, ToolCallReader

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class LoadedModel:
    """What serves requests once the model is loaded; the launcher sets it in one assignment."""

    engine: AsyncEngine
    tokenizer: Tokenizer  # the API's own instance: HF tokenizers are not safe to share across threads
    metrics: ServerMetrics


@dataclass
class ServerState:
    model_name: str
    api_key: str | None = None
    admission: Admission = field(default_factory=Admission)
    loaded: LoadedModel | None = None
    draining: bool = False
    load_error: str | None = None
    # `tool_choice: "auto"`: the parser of the model's own tool-call format (None: auto tool choice is off)
    tool_call_parser: str | None = None

    @property
    def engine(self) -> AsyncEngine | None:
        return self.loaded.engine if self.loaded is not None else None

    @property
    def ready(self) -> bool:
        return self.loaded is not None and not self.loaded.engine.is_dead and not self.draining

    def require_ready(self) -> LoadedModel:
        if self.draining:
            raise OpenAIError(503, "the server is shutting down")
        if self.loaded is None:
            raise OpenAIError(503, self.load_error or "the model is still loading")
        if self.loaded.engine.is_dead:
            raise OpenAIError(503, f"the engine is not running ({self.loaded.engine.dead_error})")
        return self.loaded


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagoda", version=pagoda.__version__)
    app.state.pagoda = state
    _install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        protected = state.api_key and request.url.path.startswith("/v1")
        if protected and request.headers.get("authorization", "") != f"Bearer {state.api_key}":
            return _error_response(OpenAIError(401, "invalid or missing API key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.ready else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagoda.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.loaded.metrics.render() if state.loaded is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        loaded = state.require_ready()
        card = {"id": state.model_name, "object": "model", "created": now(), "owned_by": "pagoda",
                "root": state.model_name, "max_model_len": loaded.engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        loaded = _admit(state, body.model)
        prompts = [_encode_prompt(loaded.tokenizer, p) for p in body.prompts()]
        params = _sampling_params(body, body.logprobs)
        await _validate(state, loaded.engine, prompts, params)
        echo = None
        if body.echo:  # the prompt as the user gave it; token-id prompts decoded
            echo = [p if isinstance(p, str) else loaded.tokenizer.decode(p) for p in body.prompts()]
        return await _respond(Generation(
            kind="completion", response_id=random_id("cmpl"), model_name=state.model_name, engine=loaded.engine,
            tokenizer=loaded.tokenizer, metrics=loaded.metrics, admission=state.admission, prompts=prompts,
            params=params, echo_texts=echo, include_usage=body.include_usage, cache_salt=body.cache_salt,
        ), body.stream, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        loaded = _admit(state, body.model)
        params = _sampling_params(body, body.num_logprobs())
        tool_reader = _tool_reader(state, body)
        tools = body.tool_dicts() if tool_reader is not None else None  # tool_choice "none": answer in text
        prompt = _render_chat(loaded.tokenizer, body.messages, body.add_generation_prompt, tools)
        await _validate(state, loaded.engine, [prompt], params)
        return await _respond(Generation(
            kind="chat", response_id=random_id("chatcmpl"), model_name=state.model_name, engine=loaded.engine,
            tokenizer=loaded.tokenizer, metrics=loaded.metrics, admission=state.admission, prompts=[prompt],
            params=params, include_usage=body.include_usage, cache_salt=body.cache_salt, tool_reader=tool_reader,
        ), body.stream, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        loaded = state.require_ready()
        if body.messages is not None:
            tokens = _render_chat(loaded.tokenizer, body.messages, body.add_generation_prompt)
        else:
            tokens = loaded.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": loaded.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        loaded = state.require_ready()
        vocab_size = len(loaded.tokenizer)
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
        return {"prompt": loaded.tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        loaded = state.require_ready()
        return {"reset_blocks": await loaded.engine.reset_prefix_cache()}

    return app


# --- request handling ------------------------------------------------------------------------------


def _admit(state: ServerState, model: str | None) -> LoadedModel:
    loaded = state.require_ready()
    if model is not None and model != state.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
    _require_room(state)
    return loaded


def _require_room(state: ServerState) -> None:
    if state.admission.full:
        raise OpenAIError(429, "the server is at its waiting-queue bound; retry later", headers={"Retry-After": "1"})


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, num_logprobs: int | None) -> SamplingParams:
    return _openai_call(lambda: body.sampling_params(num_logprobs))


def _encode_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    return list(prompt)


def _tool_reader(state: ServerState, body: ChatCompletionRequest) -> ToolCallReader | None:
    """How the choices' text becomes tool calls; None when tools do not apply (no tools, or choice "none")."""
    choice = _openai_call(body.resolved_tool_choice)
    if choice == "none":
        return None
    if choice == "auto":
        if state.tool_call_parser is None:
            raise OpenAIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                                   'and --tool-call-parser', "tool_choice")
        return ToolCallReader(parser=TOOL_CALL_PARSERS[state.tool_call_parser]())
    return ToolCallReader(forced_choice=choice)


def _openai_call(function: Callable[[], _T]) -> _T:
    """function(), with a ValueError naming a request field turned into OpenAI's 400."""
    try:
        return function()
    except ValueError as error:
        raise OpenAIError(400, str(error), getattr(error, "param", None)) from error


def _render_chat(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
    try:
        conversation = [m.for_template() for m in messages]
    except ValueError as error:  # a content part that is not text
        raise OpenAIError(400, f"cannot apply the chat template: {error}", "messages") from error
    try:
        return encode_chat(tokenizer, conversation, add_generation_prompt, tools)
    except ChatTemplateError as error:  # no template, or the template rejects the conversation
        raise OpenAIError(400, str(error), "messages") from error


async def _validate(state: ServerState, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """RequestRejected is a 400. A constrained request's validation compiles its grammar, which can take
    seconds: it runs off the event loop, and the door is checked again after it, as the wait may have let the
    server start draining or the waiting queue fill up."""
    try:
        if params.structured_outputs is None:
            _validate_all(engine, prompts, params)
        else:
            await asyncio.to_thread(_validate_all, engine, prompts, params)
            state.require_ready()
            _require_room(state)
    except RequestRejected as error:
        raise OpenAIError(400, str(error), error.param) from error


def _validate_all(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    for prompt in prompts:
        engine.validate(prompt, params)


async def _respond(generation: Generation, stream: bool, raw: Request):
    if stream:  # Starlette cancels the body iterator when the client goes away: that aborts the requests
        return StreamingResponse(generation.sse(), media_type="text/event-stream")
    # Non-streamed: race the work against the client's disconnect, which Starlette does not watch here.
    work = asyncio.create_task(generation.response())
    disconnect = asyncio.create_task(_client_gone(raw))
    done, _ = await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        disconnect.cancel()
        return JSONResponse(work.result())
    work.cancel()  # Generation's cleanup aborts its engine requests
    return Response(status_code=499)


async def _client_gone(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# --- errors ------------------------------------------------------------------------------------------


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError):
        errors = error.errors()
        if not errors or errors[0].get("type") == "json_invalid":
            return _error_response(OpenAIError(400, "the request body is not valid JSON"))
        fields = [str(e["loc"][1]) if len(e.get("loc", ())) > 1 else "" for e in errors]  # the top-level field
        message = "; ".join(f"{field}: {e.get('msg')}" for field, e in zip(fields, errors))
        return _error_response(OpenAIError(400, message, fields[0] or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        return _error_response(OpenAIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, error: Exception):
        logger.exception("unhandled error")
        return _error_response(OpenAIError(500, f"internal error: {error}"))


