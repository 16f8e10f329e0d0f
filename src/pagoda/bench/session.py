"""One benchmark of one endpoint: discover it, build each level's workload, run the levels, summarize.

Level i of a sweep uses seed + i for its prompts, so no level finds the previous level's prompts in the
server's prefix cache; warm-up prompts come from another seed still. The same seeds for every endpoint of
a `--compare` make their workloads identical.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from pagoda.bench.classes import by_class
from pagoda.bench.client import Endpoint, RequestOptions, make_http_client, make_sender, scrape_metrics
from pagoda.bench.load import LoadResult, LoadSpec, Sender, run_load
from pagoda.bench.metrics import client_verdict, summarize
from pagoda.bench.records import RequestRecord
from pagoda.bench.spec_decode import spec_decode_window
from pagoda.bench.sweep import saturation_reason, slo_capacity
from pagoda.bench.tokens import ClientTokenizer, ServerTokenizer
from pagoda.bench.workloads import Conversation, WorkloadSpec, build_workload, is_messages

WARMUP_SEED_OFFSET = 1_000_003


class Progress(Protocol):
    """A level's progress bar (tqdm's)."""

    def __enter__(self) -> Progress: ...

    def __exit__(self, *exc: object) -> None: ...

    def update(self, n: int) -> None: ...


@dataclass(frozen=True)
class BenchConfig:
    workload: WorkloadSpec
    loads: tuple[LoadSpec, ...]  # one per level, in order
    num_requests: int = 32
    waves: int = 0  # closed loop: at least this many requests per worker (num_requests >= waves x concurrency)
    warmup: int = 2
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)
    slo_min_fraction: float = 0.9  # the capacity at the SLO: the highest level where this share met it
    slo_percentile: int | None = None  # ... or where this percentile of each bounded metric is within bound
    options: RequestOptions = field(default_factory=RequestOptions)
    timeout_s: float = 600.0
    lag_tolerance_s: float = 0.02
    lag_relative: float = 0.05
    stop_at_saturation: bool = True
    min_gain: float = 0.05
    patience: int = 2
    max_error_fraction: float = 0.1
    use_server_tokenize: bool = True
    reset_prefix_cache: bool = False
    profile: bool = False  # each level's measured requests between /start_profile and /stop_profile
    progress: bool = True

    def requests_at(self, load: LoadSpec) -> int:
        """Measured requests of one level."""
        if load.concurrency is None:
            return self.num_requests
        return max(self.num_requests, self.waves * load.concurrency)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(), "levels": [load.to_dict() for load in self.loads],
            "num_requests": self.num_requests, "waves": self.waves, "warmup": self.warmup, "seed": self.seed,
            "slo_s": self.slo, "slo_min_fraction": self.slo_min_fraction, "slo_percentile": self.slo_percentile,
            "temperature": self.options.temperature, "ignore_eos": self.options.ignore_eos,
            "extra_body": self.options.extra_body, "timeout_s": self.timeout_s,
            "lag_tolerance_s": self.lag_tolerance_s, "lag_relative": self.lag_relative,
            "stop_at_saturation": self.stop_at_saturation, "min_gain": self.min_gain, "patience": self.patience,
            "max_error_fraction": self.max_error_fraction, "reset_prefix_cache": self.reset_prefix_cache,
            "profile": self.profile,
        }


async def discover(http: httpx.AsyncClient, endpoint: Endpoint) -> tuple[Endpoint, dict[str, Any]]:
    """Fills in the model name from /v1/models when not given; reads /version when the server has one."""
    info: dict[str, Any] = {"url": endpoint.url, "api": endpoint.api}
    try:
        response = await http.get(f"{endpoint.root}/v1/models", headers=endpoint.headers)
        models = [m["id"] for m in response.json().get("data", [])] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        models = []
    if endpoint.model is None:
        if not models:
            raise RuntimeError(f"{endpoint.root}: cannot list models (GET /v1/models); give --model")
        endpoint = replace(endpoint, model=models[0])
    try:
        response = await http.get(f"{endpoint.root}/version", headers=endpoint.headers)
        info["server_version"] = response.json().get("version") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        info["server_version"] = None
    info["model"] = endpoint.model
    return endpoint, info


async def fill_prompt_counts(conversations: list[Conversation], server: ServerTokenizer, api: str) -> None:
    """Exact first-turn prompt lengths from the server's /tokenize, for the prompts the client cannot count
    exactly itself (text and chat messages); token-id prompts are exact already."""
    for conversation in conversations:
        turn = conversation.turns[0]
        query: str | list[dict[str, Any]]
        if isinstance(turn.prompt, str):
            query = [{"role": "user", "content": turn.prompt}] if api == "chat" else turn.prompt
        elif is_messages(turn.prompt):
            query = turn.prompt
        else:
            continue  # token ids
        turn.expected_prompt_tokens = await server.count(query)


async def reset_prefix_cache(http: httpx.AsyncClient, endpoint: Endpoint) -> bool:
    """POST /reset_prefix_cache (pagoda; vLLM in dev mode) so a level starts cold; False when refused."""
    try:
        response = await http.post(f"{endpoint.root}/reset_prefix_cache", headers=endpoint.headers)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def count_outputs(result: LoadResult, tokenizer: ClientTokenizer | None) -> None:
    """The client tokenizer's count of each answer (after the run: it costs the client CPU)."""
    if tokenizer is None:
        return
    for record in result.records:
        text = result.outputs.get(record.request_id)
        if record.ok and text is not None:
            record.client_output_tokens = tokenizer.count(text)


def level_result(load: LoadSpec, seed: int, result: LoadResult, config: BenchConfig) -> dict[str, Any]:
    summary = summarize(result.records, slo=config.slo or None)
    summary["by_class"] = by_class(result.records, summary["duration_s"], config.slo or None)
    verdict = client_verdict(result.dispatch_lags, result.loop_lags, result.cpu_fraction, config.lag_tolerance_s,
                             relative=config.lag_relative, itl_p50=summary["itl"]["p50"],
                             mean_interarrival=None if load.rate is None or math.isinf(load.rate) else 1.0 / load.rate)
    return {
        "label": load.label(), "level": load.level if not math.isinf(load.level) else None, "load": load.to_dict(),
        "seed": seed, "wall_s": result.wall_s, "warmup": result.warmup,
        "summary": summary, "client": verdict,
        "requests": [record.to_dict() for record in result.records],
    }


async def profile(http: httpx.AsyncClient, endpoint: Endpoint, action: str) -> dict[str, Any] | None:
    """POST /start_profile or /stop_profile (vLLM's; pagoda serve with --profile-dir): the answer, or None when
    the server refuses (its routes are off)."""
    try:
        response = await http.post(f"{endpoint.root}/{action}", headers=endpoint.headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    answer = response.json() if response.content else {}
    return answer if isinstance(answer, dict) else {}


async def run_measured(http: httpx.AsyncClient, endpoint: Endpoint, sender: Sender,
                       conversations: list[Conversation], load: LoadSpec, seed: int, warmup: list[Conversation],
                       on_done: Callable[[RequestRecord], None],
                       profiled: bool = False) -> tuple[LoadResult, dict[str, object] | None, dict[str, Any] | None]:
    """One level's run, with the server's speculative-decoding figures over its measured requests (None
    when it exports none), and with `profiled` the server's answer to /stop_profile (its trace file). /metrics
    is read, and the profile started, after the warm-up; both end after the last response."""
    before: list[str | None] = []

    async def scrape_before() -> None:
        before.append(await scrape_metrics(http, endpoint))
        if profiled:
            await profile(http, endpoint, "start_profile")

    result = await run_load(sender, conversations, load, seed=seed, warmup=warmup, on_done=on_done,
                            before_measured=scrape_before)
    trace = await profile(http, endpoint, "stop_profile") if profiled else None
    return result, spec_decode_window(before[0], await scrape_metrics(http, endpoint)), trace


async def bench_endpoint(endpoint: Endpoint, config: BenchConfig, tokenizer: ClientTokenizer | None,
                         on_level: Callable[[Endpoint, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Runs every level of `config` against one endpoint (stopping at saturation when asked)."""
    async with make_http_client(config.timeout_s) as http:
        endpoint, info = await discover(http, endpoint)
        server = ServerTokenizer(http, endpoint.root, endpoint.model, endpoint.headers)
        info["tokenize"] = await server.probe() if config.use_server_tokenize else False
        sender = make_sender(http, endpoint, config.options)
        levels: list[dict[str, Any]] = []
        stop_reason = None
        for index, load in enumerate(config.loads):
            seed, num_requests = config.seed + index, config.requests_at(load)
            conversations = build_workload(config.workload, num_requests, tokenizer, endpoint.api, seed)
            warmup = []
            if index == 0 and config.warmup:
                warmup = build_workload(config.workload, config.warmup, tokenizer, endpoint.api,
                                        config.seed + WARMUP_SEED_OFFSET)
            if info["tokenize"]:
                await fill_prompt_counts(conversations, server, endpoint.api)
            reset = await reset_prefix_cache(http, endpoint) if config.reset_prefix_cache else None
            with _progress(config, num_requests, f"{endpoint.name} {load.label()}") as bar:
                result, speculative, trace = await run_measured(
                    http, endpoint, sender, conversations, load, seed, warmup, lambda record: bar.update(1),
                    config.profile)
            count_outputs(result, tokenizer)
            point = level_result(load, seed, result, config)
            point["prefix_cache_reset"] = reset
            point["speculative"] = speculative
            if config.profile:
                point["profile"] = trace  # None: the server has no profiling routes
            levels.append(point)
            if on_level is not None:
                on_level(endpoint, point)
            if len(config.loads) > 1 and config.stop_at_saturation:
                stop_reason = saturation_reason(levels, config.min_gain, config.max_error_fraction,
                                                config.patience)
                if stop_reason:
                    break
    return {"name": endpoint.name, "root": endpoint.root, **info, "levels": levels, "stop_reason": stop_reason,
            "slo_capacity": slo_capacity(levels, config.slo_min_fraction, config.slo_percentile)}


def _progress(config: BenchConfig, total: int, description: str) -> Progress:
    from tqdm import tqdm  # type: ignore[import-untyped]  # (no stubs)

    # leave=False: the level's table row replaces the bar; disable=None: no bar when stderr is not a terminal
    bar: Progress = tqdm(total=total, desc=description, unit="req", leave=False, file=sys.stderr,
                         disable=None if config.progress else True, dynamic_ncols=True)
    return bar
