"""`pagoda route`'s HTTP app: the OpenAI-compatible routes over the replicas, on the server's HTTP stack.

Generations go through `Forwarder` (retries, streams); questions about the model (/v1/models, /tokenize,
/detokenize) go to the first replica up that answers them. The router checks its own API keys
(`pagoda.api_keys`, as `pagoda serve` does), and sends the replicas either the client's Authorization or,
when configured, a key of its own for them. With tenants (router/tenancy.py) the tenants' keys open the door
too, each request is admitted against its tenant's limits before it is routed, and the client's Authorization
and the tenants file's header reach the replica unchanged whatever key the router has of its own.
No OpenAPI pages unless asked: they map the routes to anyone.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.api_keys import ApiKeyGuard, ApiKeys
from pagoda.router.core import Router
from pagoda.router.disaggregated import DisaggregatedForwarder
from pagoda.router.events import subscribe_forever
from pagoda.router.faults import Outcome, classify_answer
from pagoda.router.policies import RoutedPrompt
from pagoda.router.poller import poll_forever
from pagoda.router.proxy import Forwarder, error_response
from pagoda.router.tenancy import enter
from pagoda.router.tokens import PromptReader, embedding_as_completion, responses_as_chat
from pagoda.tenant_door import Tenants
from pagoda.version import __version__
from pagoda.wire import OpenAIError
from pagoda.wire.guards import BodySizeLimit, JsonDecoder
from pagoda.wire.limits import ServerLimits

FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


def build_router_app(router: Router, reader: PromptReader, client: httpx.AsyncClient, *,
                     limits: ServerLimits | None = None, events_topic: str = "", api_keys: ApiKeys | None = None,
                     replica_api_key: str | None = None, enable_docs: bool = False,
                     prefill_router: Router | None = None, tenants: Tenants | None = None,
                     tenant_header: str | None = None) -> FastAPI:
    """api_keys: what clients must present (none: no check). replica_api_key: sent to the replicas on every
    call (proxied requests and polls alike) in place of the client's Authorization, which is then not
    forwarded; without it, the client's Authorization goes to the replica as it came. prefill_router: the
    prefill pool of --pd-disaggregation (`router` is then the decode pool; router/disaggregated.py). tenants:
    the tenants file the router admits requests by (it then also checks the keys, in place of api_keys; its
    per-tenant counters join the router's metrics). tenant_header: a gateway's tenant header to pass on
    without a tenants file."""
    limits = limits or ServerLimits()
    if replica_api_key is not None:
        client.headers["Authorization"] = f"Bearer {replica_api_key}"
    # With tenants, the replicas find the tenant as the router did: by the client's key or the gateway's header.
    keep_authorization = replica_api_key is None or (tenants is not None and tenants.configured)
    forwarded = [name for name in FORWARDED_HEADERS if keep_authorization or name != "authorization"]
    if tenants is not None:
        tenants.register(router.metrics.registry)
    decode = Forwarder(router, client, random.Random(router.config.seed))
    forwarder: Forwarder | DisaggregatedForwarder = decode if prefill_router is None else DisaggregatedForwarder(
        Forwarder(prefill_router, client, random.Random(prefill_router.config.seed)), decode, router.metrics)
    decoder = JsonDecoder()

    def headers_of(raw: Request) -> dict[str, str]:
        names = [*forwarded, *(h for h in (tenant_header, tenants.table.header if tenants else None) if h)]
        return {name: raw.headers[name] for name in names if name in raw.headers}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        pools = [router] if prefill_router is None else [router, prefill_router]
        tasks = [asyncio.create_task(poll_forever(pool, client)) for pool in pools]
        tasks += [asyncio.create_task(subscribe_forever(pool, r, r.events_endpoint, events_topic))
                  for pool in pools for r in pool.replicas if r.events_endpoint is not None]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await client.aclose()

    docs: dict[str, Any] = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagoda router", version=__version__, lifespan=lifespan, **docs)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_request_body_bytes)
    # outermost: a request without a key is not read
    app.add_middleware(ApiKeyGuard, keys=tenants or api_keys or ApiKeys(), error_response=error_response)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Unknown routes, wrong methods, invalid Unicode in a body: OpenAI's error shape too."""
        return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=dict(error.headers) if error.headers else None)

    @app.get("/health")
    async def health() -> Response:
        now = router.clock()
        return Response(status_code=200 if any(r.routable(now) for r in router.replicas) else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """Answers whenever the process serves HTTP: the liveness probe's (/health is about the replicas)."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await _first_answer(router, client, "GET", "/v1/models", headers_of(raw))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await _first_answer(router, client, "POST", "/tokenize", headers_of(raw), await raw.body())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await _first_answer(router, client, "POST", "/detokenize", headers_of(raw), await raw.body())

    async def proxied(raw: Request, path: str, read: Callable[[dict[str, Any]], Awaitable[RoutedPrompt]]) -> Response:
        body = await raw.body()
        try:
            parsed = await decoder.decode(body)
        except ValueError:
            raise OpenAIError(400, "the request body is not valid JSON") from None
        if not isinstance(parsed, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        model = parsed.get("model")
        meter = enter(tenants, raw.headers, model, router.adapters())  # 403, 429 before any routing work
        prompt = await read(parsed)
        prompt.model = model if isinstance(model, str) else None
        if meter is not None:
            meter.start(prompt)
        # A continued response is served where its conversation is stored; an unknown id goes anywhere,
        # and that replica's 404 says so.
        previous = parsed.get("previous_response_id") if path == "/v1/responses" else None
        pinned = router.response_owners.get(previous) if isinstance(previous, str) else None
        work = forwarder.dispatch(path, body, headers_of(raw), prompt, stream=parsed.get("stream") is True,
                                  pinned=pinned, meter=meter)
        response = await _unless_client_leaves(raw, work)
        if meter is not None:
            response.headers.update(meter.headers())
        return response

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxied(raw, "/v1/completions", reader.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await proxied(raw, "/v1/chat/completions", reader.chat)

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await proxied(raw, "/v1/responses", lambda body: reader.chat(responses_as_chat(body)))

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> Response:
        return await proxied(raw, "/v1/embeddings", lambda body: reader.completion(embedding_as_completion(body)))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, raw: Request) -> Response:
        owner = router.response_owners.get(response_id)
        if owner is None:
            raise OpenAIError(404, f"no stored response with id {response_id!r} is known to this router")
        try:
            upstream = await client.get(f"{owner.url}/v1/responses/{response_id}", headers=headers_of(raw))
        except httpx.HTTPError as error:
            return error_response(502, f"the replica that holds it did not answer ({type(error).__name__})")
        return Response(upstream.content, status_code=upstream.status_code,
                        headers=Forwarder._returned_headers(upstream))

    return app


async def _first_answer(router: Router, client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str],
                        body: bytes | None = None) -> Response:
    """A request about the model, not a generation (they serve the same one): the first replica up that answers
    it without a replica-wide error answers it."""
    now = router.clock()
    for replica in [r for r in router.replicas if r.routable(now)]:
        try:
            upstream = await client.request(method, f"{replica.url}{path}", headers=headers, content=body)
        except httpx.HTTPError:
            continue
        if classify_answer(upstream.status_code, upstream.headers) is not Outcome.REPLICA_ERROR:
            return Response(upstream.content, status_code=upstream.status_code,
                            headers=Forwarder._returned_headers(upstream))
    return error_response(503, "no replica is available")


async def _unless_client_leaves(raw: Request, work: Awaitable[Response]) -> Response:
    """The routed work, raced against the client's disconnect (which Starlette does not watch before a response
    starts): a client that leaves cancels its request on the replica and frees its load at the router."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_client_gone(raw))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        gone.cancel()
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)


async def _client_gone(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
