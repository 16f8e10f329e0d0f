"""The FastAPI app: OpenAI routes, health, metrics, tokenizer routes. Never touches the scheduler."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagoda
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.engine import RequestRejected
from pagoda.server.generation import Generation
from pagoda.server.metrics import ServerMetrics
from pagoda.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    now,
    random_id,
)

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    model_name: str
    api_key: str | None = None
    engine: AsyncEngine | None = None
    tokenizer: object = None  # the API's own instance: HF tokenizers are not safe to share across threads
    metrics: ServerMetrics | None = None
    max_model_len: int = 0
    draining: bool = False
    load_error: str | None = None
    # Admission control, on the event loop only: engine requests admitted at the door that have not yet
    # produced a token count as waiting. Reserved synchronously, so a burst cannot slip past the bound.
    max_waiting_requests: int | None = None
    num_waiting: int = 0

    def reserve(self, count: int) -> None:
        self.num_waiting += count

    def release(self, count: int) -> None:
        self.num_waiting -= count

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.engine.is_dead and not self.draining

    def require_ready(self) -> AsyncEngine:
        if self.draining:
            raise OpenAIError(503, "the server is shutting down")
        if self.engine is None:
            raise OpenAIError(503, self.load_error or "the model is still loading")
        if self.engine.is_dead:
            raise OpenAIError(503, f"the engine is not running ({self.engine.dead_error})")
        return self.engine


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
        body = state.metrics.render() if state.metrics else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        state.require_ready()
        card = {"id": state.model_name, "object": "model", "created": now(), "owned_by": "pagoda",
                "root": state.model_name, "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        engine = _admit(state, body.model)
        prompts = [_encode_prompt(state, p) for p in body.prompts()]
        params = _sampling_params(body, body.logprobs)
        for prompt in prompts:
            _validate(state, prompt, params)
        echo = None
        if body.echo:  # the prompt as the user gave it; token-id prompts decoded
            echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in body.prompts()]
        return await _respond(Generation(
            kind="completion", response_id=random_id("cmpl"), model_name=state.model_name, engine=engine,
            tokenizer=state.tokenizer, metrics=state.metrics, prompts=prompts, params=params,
            echo_texts=echo, include_usage=body.include_usage, cache_salt=body.cache_salt, admission=state,
        ), body.stream, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        engine = _admit(state, body.model)
        prompt = _render_chat(state, body.messages, body.add_generation_prompt)
        params = _sampling_params(body, body.num_logprobs())
        _validate(state, prompt, params)
        return await _respond(Generation(
            kind="chat", response_id=random_id("chatcmpl"), model_name=state.model_name, engine=engine,
            tokenizer=state.tokenizer, metrics=state.metrics, prompts=[prompt], params=params,
            include_usage=body.include_usage, cache_salt=body.cache_salt, admission=state,
        ), body.stream, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.require_ready()
        if body.messages is not None:
            tokens = _render_chat(state, body.messages, body.add_generation_prompt)
        else:
            tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.require_ready()
        vocab_size = len(state.tokenizer)
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        engine = state.require_ready()
        forgotten = await engine.call(lambda e: e.kv_cache.reset_prefix_cache())
        return {"reset_blocks": forgotten}

    return app


# --- request handling ------------------------------------------------------------------------------


def _admit(state: ServerState, model: str | None) -> AsyncEngine:
    engine = state.require_ready()
    if model is not None and model != state.model_name:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
    bound = state.max_waiting_requests
    if bound is not None and state.num_waiting >= bound:
        raise OpenAIError(429, "the server is at its waiting-queue bound; retry later", headers={"Retry-After": "1"})
    return engine


def _sampling_params(body, num_logprobs: int | None):
    try:
        return body.sampling_params(num_logprobs)
    except ValueError as error:
        raise OpenAIError(400, str(error), getattr(error, "param", None)) from error


def _encode_prompt(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt, add_special_tokens=True)
    return list(prompt)


def _render_chat(state: ServerState, messages, add_generation_prompt: bool) -> list[int]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", "messages")
    try:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        text = state.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # template errors (jinja raise_exception, bad roles) are the caller's
        raise OpenAIError(400, f"cannot apply the chat template: {error}", "messages") from error
    return state.tokenizer.encode(text, add_special_tokens=False)


def _validate(state: ServerState, prompt: list[int], params) -> None:
    try:
        state.engine.engine.validate(prompt, params)
    except RequestRejected as error:
        raise OpenAIError(400, str(error), error.param) from error


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


