"""vLLM's runtime adapter routes: `POST /v1/load_lora_adapter` loads a PEFT directory under a name that requests
may then give as their `model`, `POST /v1/unload_lora_adapter` takes the name away. vLLM has them when its
VLLM_ALLOW_RUNTIME_LORA_UPDATING environment variable is set; pagoda when started with
--allow-runtime-lora-updating (which needs --enable-lora). Without it neither route exists, as in vLLM. Guarded
by the API key like every /v1 route: a caller that may load an adapter may make the server read any directory it
can. Answers as vLLM's: plain text on success, OpenAI's error JSON otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pagoda.engine.api import RequestRejected
from pagoda.lora_request import LoRARequest
from pagoda.wire.base import OpenAIError
from pagoda.wire.lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

if TYPE_CHECKING:
    from pagoda.server.state import ServerState


def mount_lora_routes(app: FastAPI, state: ServerState) -> None:
    # One change at a time: a load awaits the engine thread, and the name table must not move under it.
    changing = asyncio.Lock()
    # lora_int_id for adapters loaded here: after --lora-modules' (1..n), never reused.
    next_id = itertools.count(max((a.lora_int_id for a in state.lora_modules.values()), default=0) + 1)

    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        engine = state.require_ready().engine
        if name == state.model_name:
            raise OpenAIError(400, f"{name!r} is the served model's name, not an adapter's", "lora_name")
        async with changing:
            if name in state.lora_modules and not body.load_inplace:
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded. To replace it, "
                                  "set load_inplace to true.", "lora_name")
            adapter = LoRARequest(name, next(next_id), body.lora_path)
            try:
                await engine.add_lora(adapter)
            except RequestRejected as error:
                raise OpenAIError(400, str(error), "lora_path") from None
            state.lora_modules[name] = adapter
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        engine = state.require_ready().engine
        async with changing:
            if state.lora_modules.pop(name, None) is None:
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            await engine.remove_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
