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
from pagoda.router.poller import POLL_LOG_FILTER
from pagoda.router.tokens import LoadOnlyReader, PromptReader, TokenizingReader
from pagoda.text.pool import TokenizerPool
from pagoda.text.tokenizer import load_tokenizer

logger = logging.getLogger("pagoda.route")


def prompt_reader(tokenizer_dir: str | None) -> PromptReader:
    """Tokenizing with the model's own tokenizer and chat template (the server's code), or load-only routing."""
    if tokenizer_dir is None:
        return LoadOnlyReader()
    return TokenizingReader(TokenizerPool(load_tokenizer(tokenizer_dir)))


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
                 enable_docs: bool = False) -> int:
    if config.policy == "cache_aware" and tokenizer_dir is None:
        logger.warning("cache_aware without --tokenizer: chat and text prompts route by load alone")
    if replica_api_key is not None and not (api_keys and api_keys.enabled):
        logger.warning("--replica-api-key without --api-key: anyone who reaches the router uses the replicas' key")
    logging.getLogger("httpx").addFilter(POLL_LOG_FILTER)
    router = Router(replicas, config, event_endpoints=event_endpoints)
    app = build_router_app(router, prompt_reader(tokenizer_dir), replica_client(config), events_topic=events_topic,
                           api_keys=api_keys, replica_api_key=replica_api_key, enable_docs=enable_docs)
    logger.info("routing over %d replicas with %s on %s:%d", len(replicas), config.policy, host, port)
    RouterServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)).run()
    return 0
