"""`pagoda route`: the router's process. Builds the Router, the prompt reader and the HTTP client, and serves
the proxy app with uvicorn, as `pagoda serve` does."""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping, Sequence
from types import FrameType

import httpx
import uvicorn

from pagoda.api_keys import ApiKeys
from pagoda.router.app import build_router_app
from pagoda.router.config import RouterConfig
from pagoda.router.core import Router
from pagoda.router.disaggregated import disaggregated_routers
from pagoda.router.poller import POLL_LOG_FILTER
from pagoda.router.tokens import CHARS_PER_TOKEN, LoadOnlyReader, PromptReader, TextPrefixReader, TokenizingReader
from pagoda.tenant_door import Tenants
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import load_tokenizer

logger = logging.getLogger("pagoda.route")


def prompt_reader(tokenizer_dir: str | None, policy: str) -> PromptReader:
    """Tokenizing with the model's own tokenizer and chat template (the server's code); else, for cache_aware,
    text-prefix matching; else (policies that read no prompt) nothing."""
    if tokenizer_dir is not None:
        return TokenizingReader(TokenizerPool(load_tokenizer(tokenizer_dir)))
    return TextPrefixReader() if policy == "cache_aware" else LoadOnlyReader()


def matching_line(tokenizer_dir: str | None, policy: str, event_endpoints: Mapping[str, str] | None) -> str:
    """How prompts are matched to the replicas' caches: said at start-up."""
    if policy != "cache_aware":
        return f"{policy}: prompts are not matched to the replicas' caches"
    if tokenizer_dir is not None:
        return f"cache_aware: prompts matched by the replicas' own tokens and chat template ({tokenizer_dir})"
    line = (f"cache_aware: prompts matched by text prefix (about {CHARS_PER_TOKEN} characters a token); "
            "--tokenizer MODEL_DIR matches the replicas' own tokens")
    if event_endpoints:
        line += ", which replicas publishing KV events need: without it they are matched by load alone"
    return line


def replica_client(config: RouterConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
    # No connection cap below what the replicas' own admission allows: the router must not queue in front.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


class RouterServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's, but the signal is not raised again once serving stopped: the caller still has work
        (stopping the engines of --data-parallel-size), and the exit code is 0, as `pagoda serve`'s."""
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve_router(config: RouterConfig, replicas: Sequence[str], *, tokenizer_dir: str | None, host: str, port: int,
                 log_level: str = "warning", event_endpoints: Mapping[str, str] | None = None,
                 events_topic: str = "", api_keys: ApiKeys | None = None, replica_api_key: str | None = None,
                 enable_docs: bool = False, prefill: Sequence[str] = (), tenants: Tenants | None = None,
                 tenant_header: str | None = None) -> int:
    """replicas: every replica, or with `prefill` (--pd-disaggregation) the decode pool. tenants: the door the
    router admits requests by (router/tenancy.py); the caller reloads it (SIGHUP)."""
    if replica_api_key is not None and not (api_keys and api_keys.enabled):
        logger.warning("--replica-api-key without --api-key: anyone who reaches the router uses the replicas' key")
    logging.getLogger("httpx").addFilter(POLL_LOG_FILTER)
    def endpoints_of(urls: Sequence[str]) -> dict[str, str]:
        return {url: endpoint for url, endpoint in (event_endpoints or {}).items() if url in urls}

    prefill_router = None
    if prefill:
        router, prefill_router = disaggregated_routers(replicas, prefill, config, event_endpoints)
    else:
        router = Router(replicas, config, event_endpoints=endpoints_of(replicas))
    app = build_router_app(router, prompt_reader(tokenizer_dir, config.policy), replica_client(config),
                           events_topic=events_topic, api_keys=api_keys, replica_api_key=replica_api_key,
                           enable_docs=enable_docs, prefill_router=prefill_router, tenants=tenants,
                           tenant_header=tenant_header)
    logger.info(matching_line(tokenizer_dir, config.policy, event_endpoints))  # once the tokenizer loaded
    if prefill:
        logger.info("prefill/decode disaggregation: prompts to %d prefill replicas, answers from %d decode replicas, "
                    "with %s, on %s:%d", len(prefill), len(replicas), config.policy, host, port)
    else:
        logger.info("routing over %d replicas with %s on %s:%d", len(replicas), config.policy, host, port)
    RouterServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)).run()
    return 0
