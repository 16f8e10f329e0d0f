"""`pagoda route`'s flags. Each RouterConfig flag defaults to None ("not given"): RouterConfig holds the defaults.

Imports neither httpx nor the model code: `pagoda --help` stays cheap; `run_route` loads what routing needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping

from pagoda.api_keys import ApiKeys, add_api_key_arguments
from pagoda.flag_values import show_default
from pagoda.router.config import POLICIES, RouterConfig

# Where --replica-api-key is read from when not given (a flag's value is visible to every local user in `ps`).
REPLICA_API_KEY_ENV_VAR = "PAGODA_REPLICA_API_KEY"

# flag -> (RouterConfig field, type, help); each help ends with the field's default, read from RouterConfig
CONFIG_FLAGS: dict[str, tuple[str, type, str]] = {
    "--policy": ("policy", str, "how a replica is chosen"),
    "--hit-weight": ("hit_weight", float, "cost weight of each uncached prompt token"),
    "--queue-weight-tokens": ("queue_weight_tokens", float,
                              "cost, in tokens, of each request waiting at a replica"),
    "--kv-weight-tokens": ("kv_weight_tokens", float, "cost, in tokens, of a full KV cache"),
    "--max-replica-waiting": ("max_waiting_requests", int,
                              "skip a replica with this many requests waiting"),
    "--max-replica-kv-usage": ("max_kv_usage", float, "skip a replica whose KV usage reaches this"),
    "--hot-prefix-share": ("hot_prefix_share", float,
                           "most share of one prefix's requests in flight on one replica"),
    "--index-ttl": ("index_ttl_s", float, "seconds a routed block stays in a replica's index"),
    "--shared-kv-medium": ("shared_kv_medium", str,
                           "KV events medium of the store all replicas share: its blocks count for every replica"),
    "--block-size": ("default_block_size", int,
                     "block size until a replica publishes vllm:cache_config_info"),
    "--poll-interval": ("poll_interval_s", float, "seconds between health/metrics polls"),
    "--breaker-failures": ("breaker_failures", int,
                           "consecutive failures (no answer, or a 5xx not marked as the request's own) that "
                           "eject a replica"),
    "--breaker-cooldown": ("breaker_cooldown_s", float, "seconds an ejected replica sits out"),
    "--max-retries": ("max_retries", int, "other replicas tried before the client sees a failure"),
    "--retry-backoff": ("retry_backoff_s", float, "first retry's backoff in seconds, jittered"),
    "--request-timeout": ("request_timeout_s", float, "seconds a replica may take to answer"),
    "--seed": ("seed", int, "seed of the random and power_of_two policies"),
}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    route = commands.add_parser("route", help="OpenAI-compatible router over several replicas (docs/router.md)")
    route.add_argument("--replica", action="append", default=None, metavar="URL",
                       help="a replica's base URL, e.g. http://10.0.0.5:8000 (repeat for each)")
    route.add_argument("--pd-disaggregation", action="store_true",
                       help="prefill/decode disaggregation: each prompt computed on a --prefill replica, its KV "
                            "pulled by a --decode replica that answers (docs/disaggregation.md)")
    route.add_argument("--prefill", action="append", default=None, metavar="URL",
                       help="with --pd-disaggregation: a prefill replica's base URL (repeat for each)")
    route.add_argument("--decode", action="append", default=None, metavar="URL",
                       help="with --pd-disaggregation: a decode replica's base URL (repeat for each)")
    route.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                       help="the replicas' model directory: cache_aware matches prompts by its tokenizer and chat "
                            "template, as the replicas cache them (default: by text prefix)")
    route.add_argument("--replica-kv-events", action="append", default=None, metavar="URL=ENDPOINT",
                       help="a replica that publishes KV events (serve --kv-events-config), and where: "
                            "http://10.0.0.5:8000=tcp://10.0.0.5:5557; its index then follows them exactly")
    route.add_argument("--kv-events-topic", default="", help="the replicas' KV events topic (default: all)")
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=8080)
    route.add_argument("--uvicorn-log-level", default="warning")
    add_api_key_arguments(route)
    route.add_argument("--replica-api-key", default=None, metavar="KEY",
                       help="send the replicas `Authorization: Bearer KEY` (on requests and polls) instead of the "
                            f"client's Authorization (also: {REPLICA_API_KEY_ENV_VAR})")
    route.add_argument("--tenant-config", default=None, metavar="PATH",
                       help="a tenants file (pagoda serve's): the router admits each request against its tenant's "
                            "limits, once for the whole fleet; reloaded on SIGHUP (docs/tenants.md)")
    route.add_argument("--tenant-header", default=None, metavar="NAME",
                       help="a gateway's tenant header to pass on to the replicas (the tenants file's header is "
                            "passed anyway; the client's Authorization is, unless --replica-api-key)")
    route.add_argument("--enable-docs", action="store_true",
                       help="serve the OpenAPI pages (/docs, /redoc, /openapi.json); off by default")
    for flag, (field, kind, text) in CONFIG_FLAGS.items():
        choices = POLICIES if field == "policy" else None
        route.add_argument(flag, dest=field, type=kind, default=None, choices=choices,
                           help=f"{text} (default {show_default(getattr(RouterConfig, field))})")
    route.set_defaults(func=run_route)


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)
             if getattr(args, f.name, None) is not None}
    return RouterConfig(**given)


def event_endpoints(pairs: list[str] | None) -> dict[str, str]:
    """--replica-kv-events URL=ENDPOINT, each."""
    endpoints = {}
    for pair in pairs or ():
        url, separator, endpoint = pair.partition("=")
        if not separator or not url or not endpoint:
            raise ValueError(f"--replica-kv-events takes URL=ENDPOINT, not {pair!r}")
        endpoints[url] = endpoint
    return endpoints


def replica_api_key(given: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """--replica-api-key, else PAGODA_REPLICA_API_KEY, else None (the clients' keys are forwarded)."""
    key = given if given is not None else environ.get(REPLICA_API_KEY_ENV_VAR) or None
    if key is not None and (not key or key != key.strip()):
        raise ValueError("--replica-api-key must be non-empty and carry no surrounding whitespace")
    return key


def replica_pools(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the replicas answering requests, the prefill pool): --replica's and none, or with --pd-disaggregation
    --decode's and --prefill's."""
    if not args.pd_disaggregation:
        if args.prefill or args.decode:
            raise ValueError("--prefill and --decode need --pd-disaggregation")
        if not args.replica:
            raise ValueError("give at least one --replica URL")
        return args.replica, []
    if args.replica:
        raise ValueError("--pd-disaggregation takes --prefill and --decode pools, not --replica")
    if not args.prefill or not args.decode:
        raise ValueError("--pd-disaggregation needs at least one --prefill and one --decode URL")
    overlap = sorted(set(args.prefill) & set(args.decode))
    if overlap:
        raise ValueError(f"a replica is in both pools: {', '.join(overlap)} (serve it with kv_role kv_both and "
                         "give it once)")
    return args.decode, args.prefill


def run_route(args: argparse.Namespace) -> int:
    from pagoda.tenant_door import Tenants

    try:
        replicas, prefill = replica_pools(args)
        config = router_config_from(args)
        endpoints = event_endpoints(args.replica_kv_events)
        api_keys = ApiKeys.from_args(args)
        replica_key = replica_api_key(args.replica_api_key)
        tenants = Tenants(api_keys, args.tenant_config) if args.tenant_config else None
    except (OSError, ValueError) as error:
        raise SystemExit(f"pagoda route: {error}") from None
    unknown = sorted(set(endpoints) - set(replicas) - set(prefill))
    if unknown:
        raise SystemExit(f"pagoda route: --replica-kv-events for URLs not given as replicas: {', '.join(unknown)}")
    from pagoda.model_dir import ModelLoadError
    from pagoda.router.launcher import serve_router

    if tenants is not None:
        signal.signal(signal.SIGHUP, lambda _signum, _frame: tenants.reload())
    try:
        return serve_router(config, replicas, tokenizer_dir=args.tokenizer, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, event_endpoints=endpoints,
                            events_topic=args.kv_events_topic, api_keys=api_keys, replica_api_key=replica_key,
                            enable_docs=args.enable_docs, prefill=prefill, tenants=tenants,
                            tenant_header=args.tenant_header.lower() if args.tenant_header else None)
    except ModelLoadError as error:  # --tokenizer's directory, read before the router listens
        print(f"pagoda route: {error}", file=sys.stderr)
        return 2
