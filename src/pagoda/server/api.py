"""The FastAPI app: OpenAI routes, health, metrics, tokenizer routes. Never touches the scheduler.

Nothing whose cost grows with what a client sends runs on the event loop: bodies are bounded and decoded
off it (guards.py), tokenization, chat templates and detokenization run on a tokenizer pool
(tokenizers.py), and every bound is checked before the work it bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from pagoda.api_keys import ApiKeyGuard
from pagoda.engine.api import RequestRejected
from pagoda.engine.async_engine import AsyncEngine
from pagoda.lora_request import LoRARequest
from pagoda.sampling import SamplingParams
from pagoda.server.admission import WaitingSlots
from pagoda.server.chat_output import ChatOutputFormat
from pagoda.server.embeddings import mount_embeddings, require_generate_runner
from pagoda.server.errors import install_error_handlers
from pagoda.server.generation import Generation
from pagoda.server.lora_routes import mount_lora_routes
from pagoda.server.openapi import install_openapi
from pagoda.server.profile import mount_profile
from pagoda.server.prompts import check_prompt_chars, conversation_of, echo_texts, encode_prompts, render_chat_prompt
from pagoda.server.responses import ResponseAnswer
from pagoda.server.state import LoadedModel, ServerState
from pagoda.server.tenancy import TenantPass
from pagoda.server.tools import ToolCallReader
from pagoda.server.web import mount_web_ui
from pagoda.text.reasoning import REASONING_PARSERS
from pagoda.version import __version__
from pagoda.wire import (
    WIRE_LIMITS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    now,
    random_id,
)
from pagoda.wire.base import error_message
from pagoda.wire.guards import BodySizeLimit, JsonDecoder, error_response
from pagoda.wire.responses import CHAT_TO_RESPONSES_FIELD, ResponsesChatRequest, ResponsesRequest

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Engine-side validation walks every prompt token in Python: past this many it runs on a worker thread.
INLINE_VALIDATION_MAX_TOKENS = 16384


class _WireRequest(Request):
    """Its JSON is decoded by the server's JsonDecoder: off the event loop, invalid Unicode refused."""

    async def json(self) -> Any:
        if not hasattr(self, "_wire_json"):
            decoder: JsonDecoder = self.app.state.pagoda.json_decoder
            self._wire_json = await decoder.decode(await self.body())
        return self._wire_json


class _WireRoute(APIRoute):
    """Every route reads its body through _WireRequest, with this server's WireLimits in force while FastAPI
    validates it."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            token = WIRE_LIMITS.set(request.app.state.pagoda.wire_limits())
            try:
                return await handler(_WireRequest(request.scope, request.receive))
            finally:
                WIRE_LIMITS.reset(token)

        return route


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="pagoda", version=__version__)
    app.router.route_class = _WireRoute
    app.state.pagoda = state
    install_error_handlers(app)
    install_openapi(app)
    web_pages = mount_web_ui(app, state) if state.web_ui else frozenset()  # static: served without a key
    if state.profile_dir is not None:
        mount_profile(app, state, state.profile_dir)
    if state.runtime_lora_updating:
        mount_lora_routes(app, state)
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_request_body_bytes)
    # outermost: a request without a key is not read
    app.add_middleware(ApiKeyGuard, keys=state.tenants, error_response=error_response, public_paths=web_pages)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.ready else 503)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.loaded.metrics.render() if state.loaded is not None else b""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        loaded = state.require_ready()
        created, max_model_len = now(), loaded.engine.max_model_len
        card = {"id": state.model_name, "object": "model", "created": created, "owned_by": "pagoda",
                "root": state.model_name, "max_model_len": max_model_len}
        # vLLM's adapter cards: the adapter's path as root, the base model as parent.
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "pagoda",
                     "root": adapter.lora_path, "parent": adapter.base_model_name or state.model_name,
                     "max_model_len": max_model_len} for name, adapter in state.lora_modules.items()]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        arrival, loaded = time.monotonic(), _admit(state, body.model)
        model_name, adapter = _served(state, body.model)
        tenant = _tenant(state, raw, adapter)
        inputs = body.prompts()
        for text in inputs:
            if isinstance(text, str):
                check_prompt_chars(state, loaded, len(text), "prompt")
        params = _sampling_params(body, body.logprobs)
        with _holding(_reserve(state, len(inputs), params.n)) as slots:
            prompts = await encode_prompts(loaded, inputs)
            await _validate(state, loaded.engine, prompts, params, body.priority)
            echo = await echo_texts(loaded, inputs) if body.echo else None
            generation = Generation(
                kind="completion", response_id=random_id("cmpl"), model_name=model_name, lora_request=adapter,
                engine=loaded.engine, token_texts=loaded.token_texts, metrics=loaded.metrics, slots=slots,
                prompts=prompts, params=params, echo_texts=echo, include_usage=body.include_usage,
                cache_salt=body.cache_salt, deadline=state.deadline(arrival), priority=body.priority, tenant=tenant,
            )
        return await _respond(generation, body.stream, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        arrival, loaded = time.monotonic(), _admit(state, body.model)
        served = _served(state, body.model)
        generation = await _chat_generation(state, loaded, body, arrival, body.include_usage, served,
                                            _tenant(state, raw, served[1]))
        return await _respond(generation, body.stream, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        arrival, loaded = time.monotonic(), _admit(state, body.model)
        history = [] if body.previous_response_id is None else \
            state.responses.get(body.previous_response_id, "previous_response_id").conversation
        chat = _responses_chat_request(body, history)
        served = _served(state, body.model)
        answer = ResponseAnswer(body, served[0], history + body.input_messages(), state.responses)
        generation = await _chat_generation(state, loaded, chat, arrival, True, served, _tenant(state, raw, served[1]))
        return await _respond(generation, body.stream, raw, answer)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> dict[str, Any]:
        state.require_ready()
        return state.responses.get(response_id).response

    mount_embeddings(app, state)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        loaded = state.require_ready()
        if body.messages is not None:
            conversation = conversation_of(state, loaded, body.messages)
            tokens = await render_chat_prompt(state, loaded, conversation, body.add_generation_prompt,
                                              template_kwargs=body.chat_template_kwargs)
        else:
            text, special = body.prompt or "", body.add_special_tokens
            check_prompt_chars(state, loaded, len(text), "prompt")
            tokens = await loaded.tokenizers.run(
                lambda tokenizer: list(tokenizer.encode(text, add_special_tokens=special)))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": loaded.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        loaded = state.require_ready()
        vocab_size = len(loaded.tokenizer)
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {vocab_size})", "tokens")
        tokens = body.tokens
        return {"prompt": await loaded.tokenizers.run(lambda tokenizer: tokenizer.decode(tokens))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        loaded = state.require_ready()
        return {"reset_blocks": await loaded.engine.reset_prefix_cache()}

    return app


# --- request handling ------------------------------------------------------------------------------


def _admit(state: ServerState, model: str | None) -> LoadedModel:
    """The generate routes' door."""
    loaded = state.require_ready()
    state.adapter(model)  # a name that is neither the model's nor an adapter's: 404
    require_generate_runner(loaded)
    return loaded


def _served(state: ServerState, model: str | None) -> tuple[str, LoRARequest | None]:
    """The name the answer carries, and the LoRA adapter the request's model names (None: the base model)."""
    adapter = state.adapter(model)
    return (state.model_name, None) if adapter is None else (adapter.lora_name, adapter)


def _tenant(state: ServerState, raw: Request, adapter: LoRARequest | None) -> TenantPass | None:
    """The request's tenant, admitted (403, 429 otherwise; server/tenancy.py); None: nobody's."""
    return state.tenants.enter(raw.headers, adapter.lora_name if adapter is not None else None)


def _reserve(state: ServerState, num_prompts: int, n: int) -> WaitingSlots:
    """The request's waiting slots (prompts x n), after its own bound: 400 beyond it, 429 when the queue is
    too full to take the whole request now."""
    wanted, bound = num_prompts * n, state.limits.max_sequences_per_request
    if wanted > bound:
        raise OpenAIError(400, f"the request asks for {wanted} sequences (prompts x n); at most {bound} are "
                               f"allowed (--max-sequences-per-request)", "n" if n > 1 else "prompt")
    return state.admission.admit(num_prompts, n)


@contextmanager
def _holding(slots: WaitingSlots) -> Iterator[WaitingSlots]:
    """Gives the slots back if the request fails (or is cancelled) before its Generation owns them."""
    try:
        yield slots
    except BaseException:
        slots.release()
        raise


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, num_logprobs: int | None) -> SamplingParams:
    return _openai_call(lambda: body.sampling_params(num_logprobs))


def _tool_reader(state: ServerState, body: ChatCompletionRequest) -> ToolCallReader | None:
    """How the choices' text becomes tool calls; None when tools do not apply (no tools, or choice "none")."""
    choice = _openai_call(body.resolved_tool_choice)
    if choice == "none":
        return None
    if choice == "auto":
        if state.tool_call_parser is None:
            raise OpenAIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                                   'and --tool-call-parser', "tool_choice")
        return ToolCallReader.auto(state.tool_call_parser)
    return ToolCallReader(forced_choice=choice)


def _chat_output(state: ServerState, body: ChatCompletionRequest,
                 tool_reader: ToolCallReader | None) -> ChatOutputFormat:
    parser = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser is not None else None
    return ChatOutputFormat(tools=tool_reader, reasoning=parser, include_reasoning=body.include_reasoning)


def _openai_call(function: Callable[[], _T]) -> _T:
    """function(), with a ValueError naming a request field turned into OpenAI's 400."""
    try:
        return function()
    except ValueError as error:
        raise OpenAIError(400, str(error), getattr(error, "param", None)) from error


async def _validate(
    state: ServerState, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, priority: int = 0
) -> None:
    """RequestRejected is a 400. A constrained request's validation compiles its grammar, which can take
    seconds, and a long prompt's walks every token: those run off the event loop, and the door is checked
    again after them, as the wait may have let the server start draining."""
    try:
        if params.structured_outputs is None and sum(map(len, prompts)) <= INLINE_VALIDATION_MAX_TOKENS:
            _validate_all(engine, prompts, params, priority)
        else:
            await asyncio.to_thread(_validate_all, engine, prompts, params, priority)
            state.require_ready()
    except RequestRejected as error:
        raise OpenAIError(400, str(error), error.param) from error


def _validate_all(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, priority: int) -> None:
    for prompt in prompts:
        engine.validate(prompt, params, priority)


async def _chat_generation(state: ServerState, loaded: LoadedModel, body: ChatCompletionRequest, arrival: float,
                           include_usage: bool, served: tuple[str, LoRARequest | None],
                           tenant: TenantPass | None) -> Generation:
    params = _sampling_params(body, body.num_logprobs())
    tool_reader = _tool_reader(state, body)
    if tool_reader is not None:
        params = tool_reader.sampling_params(params)
    tools = body.tool_dicts() if tool_reader is not None else None  # tool_choice "none": answer in text
    conversation = conversation_of(state, loaded, body.messages)
    with _holding(_reserve(state, 1, params.n)) as slots:
        prompt = await render_chat_prompt(state, loaded, conversation, body.add_generation_prompt, tools,
                                          body.chat_template_kwargs)
        await _validate(state, loaded.engine, [prompt], params, body.priority)
        return Generation(
            kind="chat", response_id=random_id("chatcmpl"), model_name=served[0], lora_request=served[1],
            engine=loaded.engine, token_texts=loaded.token_texts, metrics=loaded.metrics, slots=slots,
            prompts=[prompt], params=params, include_usage=include_usage, cache_salt=body.cache_salt,
            chat_output=_chat_output(state, body, tool_reader), deadline=state.deadline(arrival),
            priority=body.priority, tenant=tenant,
        )


def _responses_chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ResponsesChatRequest:
    """The chat request a Responses request is; a 400 names the Responses field at fault."""
    fields = _openai_call(lambda: body.chat_fields(history))
    try:
        return ResponsesChatRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        param = CHAT_TO_RESPONSES_FIELD.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
        raise OpenAIError(400, f"{param}: {error_message(first)}" if param else error_message(first),
                          param) from error


async def _respond(generation: Generation, stream: bool, raw: Request,
                   answer: ResponseAnswer | None = None) -> Response:
    """The generation's answer: chat or completion chunks, or (with `answer`) the Responses API's shape."""
    headers = generation.tenant.headers() if generation.tenant is not None else None  # its rate limits' state
    if stream:  # Starlette cancels the body iterator when the client goes away: that aborts the requests
        events = generation.sse() if answer is None else answer.events(generation.chunks())
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    # Non-streamed: race the work against the client's disconnect, which Starlette does not watch here.
    work = asyncio.create_task(generation.response() if answer is None else _as_response(generation, answer))
    disconnect = asyncio.create_task(_client_gone(raw))
    done, _ = await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        disconnect.cancel()
        return JSONResponse(work.result(), headers=headers)
    work.cancel()  # Generation's cleanup aborts its engine requests
    return Response(status_code=499)


async def _as_response(generation: Generation, answer: ResponseAnswer) -> dict[str, Any]:
    return answer.from_completion(await generation.response())


async def _client_gone(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
