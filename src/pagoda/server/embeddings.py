"""POST /v1/embeddings (OpenAI's shape) on a server whose engine runs the pooling runner.

One engine request per input, all submitted at once so the scheduler batches them; the answer waits for all.
A server running the generate runner answers this route with a 400 naming `model`, as vLLM does ("The model
does not support Embeddings API"); a pooling server's generate routes answer the same way (server/api.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import FastAPI, Request

from pagoda.engine.api import EmbeddingRequestOutput, EngineDeadError, RequestFailed, RequestRejected
from pagoda.pooling import PoolingParams
from pagoda.server.prompts import check_prompt_chars, encode_prompts
from pagoda.server.state import LoadedModel, ServerState
from pagoda.wire import ERROR_SCOPE_HEADER, REQUEST_SCOPE, OpenAIError, random_id
from pagoda.wire.embeddings import EmbeddingRequest, encode_embedding

logger = logging.getLogger(__name__)

NOT_AN_EMBEDDING_MODEL = ("The model does not support the Embeddings API: it runs the generate runner (start the "
                          "server with --runner pooling to serve it as an embedding model)")
NOT_A_GENERATIVE_MODEL = ("The model does not support generation: it runs the pooling runner (--runner pooling) "
                          "and answers /v1/embeddings only")


def require_generate_runner(loaded: LoadedModel) -> None:
    """The generate routes' check: a pooling server refuses them before any work."""
    if loaded.engine.description.runner == "pooling":
        raise OpenAIError(400, NOT_A_GENERATIVE_MODEL, "model")


def mount_embeddings(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        arrival, loaded = time.monotonic(), state.require_ready()
        if state.adapter(body.model) is not None:  # a name neither the model's nor an adapter's: 404
            raise OpenAIError(400, "LoRA adapters are not supported with embeddings", "model")
        if loaded.engine.description.runner != "pooling":
            raise OpenAIError(400, NOT_AN_EMBEDDING_MODEL, "model")
        tenant = state.tenants.enter(raw.headers, None)
        try:
            inputs = body.inputs()
        except ValueError as error:
            raise OpenAIError(400, str(error), "input") from error
        for text in inputs:
            if isinstance(text, str):
                check_prompt_chars(state, loaded, len(text), "input")
        bound = state.limits.max_sequences_per_request
        if len(inputs) > bound:
            raise OpenAIError(400, f"the request asks for {len(inputs)} embeddings; at most {bound} are allowed "
                                   "(--max-sequences-per-request)", "input")
        params = PoolingParams(dimensions=body.dimensions)
        slots = state.admission.admit(len(inputs), 1)
        try:
            prompts = await encode_prompts(loaded, inputs)
            _validate(loaded, prompts, params)
            if tenant is not None:
                tenant.charge(sum(map(len, prompts)), "prompt")
            outputs = await _embed_all(loaded, random_id("embd"), prompts, params, state.deadline(arrival))
        finally:
            slots.release()
        data = [{"object": "embedding", "index": index,
                 "embedding": encode_embedding(output.outputs.embedding, body.encoding_format)}
                for index, output in enumerate(outputs)]
        num_tokens = sum(len(prompt) for prompt in prompts)
        return {"object": "list", "data": data, "model": state.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _validate(loaded: LoadedModel, prompts: list[list[int]], params: PoolingParams) -> None:
    """RequestRejected is a 400; a prompt's fault names `input` (the engine calls it the prompt)."""
    try:
        for prompt in prompts:
            loaded.engine.validate_embedding(prompt, params)
    except RequestRejected as error:
        raise OpenAIError(400, str(error), "input" if error.param == "prompt" else error.param) from error


async def _embed_all(loaded: LoadedModel, response_id: str, prompts: list[list[int]], params: PoolingParams,
                     deadline: float | None) -> list[EmbeddingRequestOutput]:
    """Every prompt's embedding, in order; cancelled together (each aborted in the engine) on a failure or at
    the deadline."""
    tasks = [asyncio.ensure_future(loaded.engine.embed(f"{response_id}-{index}", prompt, params))
             for index, prompt in enumerate(prompts)]
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            failure = task.exception()
            if failure is not None:
                raise failure
        if pending:
            logger.info("request %s passed its deadline: aborted", response_id)
            raise OpenAIError(504, "the request did not finish within the server's time limit (--request-timeout)")
        return [task.result() for task in tasks]
    except EngineDeadError as error:
        raise OpenAIError(503, "the engine is not running") from error
    except RequestFailed as error:
        logger.error("request %s failed: %s", response_id, error, exc_info=error)
        headers = {ERROR_SCOPE_HEADER: REQUEST_SCOPE} if error.alone else None
        raise OpenAIError(500, f"internal error (request id {response_id})", headers=headers) from error
    finally:
        for task in tasks:
            task.cancel()
