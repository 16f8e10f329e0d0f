"""What the server holds between requests: its settings, and the loaded model once there is one.

Routes (api.py), prompt preparation (prompts.py) and the web UI (web.py) all read it; the launcher builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagoda.api_keys import ApiKeys
from pagoda.engine.async_engine import AsyncEngine
from pagoda.lora_request import LoRARequest
from pagoda.server.admission import Admission
from pagoda.server.logprobs import TokenTexts
from pagoda.server.metrics import ServerMetrics
from pagoda.server.responses import ResponseStore
from pagoda.server.tenancy import Tenants
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import Tokenizer
from pagoda.wire import OpenAIError, WireLimits
from pagoda.wire.guards import JsonDecoder
from pagoda.wire.limits import ServerLimits


@dataclass(frozen=True)
class LoadedModel:
    """What serves requests once the model is loaded; the launcher sets it in one assignment."""

    engine: AsyncEngine
    tokenizer: Tokenizer  # the event loop's own instance (for cheap decodes): not safe to share across threads
    metrics: ServerMetrics
    tokenizers: TokenizerPool  # copies for the worker threads: everything whose cost grows with the input
    token_texts: TokenTexts = field(init=False)  # single-token decodes (logprobs), cached, on the event loop

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_texts", TokenTexts(self.tokenizer))


@dataclass
class ServerState:
    model_name: str
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    limits: ServerLimits = field(default_factory=ServerLimits)
    admission: Admission = field(default_factory=Admission)
    loaded: LoadedModel | None = None
    draining: bool = False
    load_error: str | None = None
    # `tool_choice: "auto"`: the parser of the model's own tool-call format (None: auto tool choice is off)
    tool_call_parser: str | None = None
    # the thinking model's format: its output split into reasoning and answer (None: all of it is content)
    reasoning_parser: str | None = None
    json_decoder: JsonDecoder = field(default_factory=JsonDecoder)
    web_ui: bool = True  # the chat page at / and the dashboard (server/web.py); --disable-web-ui
    builtin_model: bool = False  # pagoda's own demo model: the chat page introduces it (server/web.py)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept to be continued
    profile_dir: Path | None = None  # --profile-dir: where /stop_profile writes step timelines (None: no routes)
    # --lora-modules: the adapters a request's `model` may name, by name (loaded and checked at start-up)
    # ... and those loaded since by POST /v1/load_lora_adapter, which exists with --allow-runtime-lora-updating
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    runtime_lora_updating: bool = False
    # --tenant-config: who a request is for and its limits; also the keys the guard accepts (built from api_keys
    # when not given: no tenants)
    tenants: Tenants = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.tenants is None:
            self.tenants = Tenants(self.api_keys)

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

    def adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names; None for the base model (or no name). 404 for another."""
        if model is None or model == self.model_name:
            return None
        adapter = self.lora_modules.get(model)
        if adapter is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return adapter

    def wire_limits(self) -> WireLimits:
        return WireLimits.of(self.limits, self.loaded.engine.max_model_len if self.loaded is not None else None)

    def deadline(self, arrival: float) -> float | None:
        timeout = self.limits.request_timeout
        return arrival + timeout if timeout else None
