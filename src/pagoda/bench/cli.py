"""`pagoda bench`: argparse wiring. The main CLI calls add_parser(subparsers); `python -m pagoda.bench` main()."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.bench.client import APIS, Endpoint, RequestOptions
from pagoda.bench.load import ARRIVALS, LoadSpec
from pagoda.bench.metrics import PERCENTILES, parse_slo
from pagoda.bench.session import BenchConfig, bench_endpoint
from pagoda.bench.sweep import doubling_levels, parse_levels
from pagoda.bench.workloads import (
    KINDS,
    LENGTH_DISTRIBUTIONS,
    WorkloadSpec,
    parse_priority_mix,
    parse_tenant_mix,
)

if TYPE_CHECKING:
    from pagoda.bench.tokens import ClientTokenizer

DESCRIPTION = (
    "Load-test any OpenAI-compatible server (completions or chat, streamed): closed loop (fixed concurrency) "
    "or open loop (constant / Poisson / gamma arrivals), sweeps that stop at saturation, TTFT / TPOT / ITL / "
    "E2E percentiles, throughputs, goodput under SLOs, a check that the client itself kept up, and "
    "speculative decoding's acceptance when the server's /metrics has vLLM's counters. "
    "Metric definitions: docs/bench.md."
)
EXAMPLE = ("example: pagoda bench --base-url http://127.0.0.1:8000 --tokenizer models/bench-125m "
           "--concurrency 1,2,4,8 --input-len 128 --output-len 32 --ignore-eos --out results/run.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", help="server URL, with or without /v1 (e.g. http://127.0.0.1:8000)")
    target.add_argument("--compare", nargs="+", metavar="[NAME=]URL",
                        help="run the same workload against each of these endpoints (plus --base-url)")
    target.add_argument("--api", choices=APIS, default="completions")
    target.add_argument("--model", help="model name to ask for (default: the first of GET /v1/models)")
    target.add_argument("--api-key", help="sent as a bearer token")
    target.add_argument("--tenant-header", metavar="HEADER",
                        help="send each request's tenant (--tenant-mix) in this header, as a gateway in front of "
                             "pagoda serve --tenant-config would (its tenant_header)")
    target.add_argument("--tenant-api-keys", metavar="NAME=KEY,...",
                        help="send each request's tenant (--tenant-mix) as that tenant's API key")
    target.add_argument("--tokenizer", help="local tokenizer directory (tokenizer.json): exact-length prompts, "
                        "token cross-checks (default: --model when it is a local directory)")
    target.add_argument("--no-server-tokenize", action="store_true", help="do not use the server's /tokenize")
    target.add_argument("--profile", action="store_true",
                        help="POST /start_profile and /stop_profile around each level's measured requests (pagoda "
                             "serve --profile-dir; vLLM with its profiler directory): the trace file in the JSON")
    target.add_argument("--reset-prefix-cache", action="store_true",
                        help="POST /reset_prefix_cache before each level (pagoda; vLLM in dev mode): cold prefills")

    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=KINDS, default="random")
    work.add_argument("--dataset", help="JSONL file for --workload jsonl")
    work.add_argument("--input-len", type=int, default=128, help="prompt tokens (128)")
    work.add_argument("--input-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed")
    work.add_argument("--input-spread", type=float, default=0.0, help="uniform: +- fraction; normal: std fraction")
    work.add_argument("--output-len", type=int, default=32, help="max_tokens per request (32)")
    work.add_argument("--output-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed")
    work.add_argument("--output-spread", type=float, default=0.0)
    work.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: groups (4)")
    work.add_argument("--prefix-len", type=int, default=64, help="shared-prefix: tokens shared in a group (64)")
    work.add_argument("--num-turns", type=int, default=3, help="multi-turn: user turns per conversation (3)")
    work.add_argument("--priority-mix", help="send vLLM's priority, drawn per conversation from PRIORITY=WEIGHT "
                                             "pairs, e.g. 0=3,1=1 (the server needs --scheduling-policy priority)")
    work.add_argument("--tenant-mix", help="send each conversation for a tenant drawn from NAME=WEIGHT pairs, "
                                           "e.g. alice=3,bob=1 (with --tenant-header or --tenant-api-keys); "
                                           "latencies per tenant")
    work.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    work.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", help="closed loop: requests in flight; a list (1,2,4) is a sweep (1)")
    load.add_argument("--request-rate", help="open loop: requests/s ('inf' = all at once); a list is a sweep")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument("--num-requests", type=int, default=32, help="measured requests per level (32)")
    load.add_argument("--waves", type=int, default=0,
                      help="closed loop: at least this many requests per worker at each level (N >= waves x C)")
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level (2)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request (600)")
    load.add_argument("--sweep", action="store_true", help="one start level: double it until saturation")
    load.add_argument("--sweep-max", type=float, default=256, help="--sweep's highest level (256)")
    load.add_argument("--no-stop-at-saturation", action="store_true", help="run every level of a sweep")
    load.add_argument("--saturation-gain", type=float, default=0.05,
                      help="levels that add less output throughput than this fraction are flat (0.05)")
    load.add_argument("--saturation-patience", type=int, default=2,
                      help="this many flat levels in a row stop the sweep (2)")

    out = parser.add_argument_group("metrics and output")
    out.add_argument("--slo", help="goodput bounds, e.g. ttft=500ms,tpot=50ms,e2e=10s (bare numbers are ms)")
    out.add_argument("--slo-min-fraction", type=float, default=0.9,
                     help="a sweep's capacity at the SLO is the highest level where at least this fraction of "
                          "requests met it (0.9)")
    out.add_argument("--slo-percentile", type=int, choices=PERCENTILES,
                     help="... or where this percentile of each SLO metric is within its bound (failed requests "
                          "count as misses), e.g. 99")
    out.add_argument("--lag-tolerance-ms", type=float, default=20.0,
                     help="client lag (dispatch or event loop, p99) above which the run says it fell behind (20)")
    out.add_argument("--lag-relative", type=float, default=0.05,
                     help="... or this fraction of the interval the lag distorts (median ITL, mean arrival gap), "
                     "when larger (0.05)")
    out.add_argument("--out", help="JSON file (default: bench-<time>.json here)")
    out.add_argument("--plot", help="PNG file (default: the JSON's name with .png)")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument("--note", help="free text stored in the JSON (e.g. what else ran on the machine)")
    out.add_argument("--no-progress", action="store_true")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help="load-test an OpenAI-compatible server", description=DESCRIPTION,
                                   epilog=EXAMPLE)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def endpoints_from(args: argparse.Namespace) -> list[Endpoint]:
    urls = ([args.base_url] if args.base_url else []) + list(args.compare or [])
    if not urls:
        raise ValueError("give --base-url (or --compare URL ...)")
    keys = tenant_keys(args.tenant_api_keys)
    tenants = [name for name, _ in parse_tenant_mix(args.tenant_mix)]
    if tenants and args.tenant_header is None:
        if not keys:
            raise ValueError("--tenant-mix needs --tenant-header or --tenant-api-keys: how the server learns whose "
                             "request it is")
        if missing := [name for name in tenants if name not in dict(keys)]:
            raise ValueError(f"--tenant-api-keys has no key for tenant(s) {', '.join(missing)} of --tenant-mix")
    return [replace(Endpoint.parse(url, api=args.api, model=args.model, api_key=args.api_key),
                    tenant_header=args.tenant_header, tenant_keys=keys) for url in urls]


def tenant_keys(text: str | None) -> tuple[tuple[str, str], ...]:
    """`alice=KEY1,bob=KEY2` -> (("alice", "KEY1"), ("bob", "KEY2"))."""
    pairs = []
    for part in (text or "").split(","):
        name, _, key = part.partition("=")
        if part.strip() and not (name.strip() and key.strip()):
            raise ValueError(f"--tenant-api-keys entry {part!r}: expected NAME=KEY")
        if part.strip():
            pairs.append((name.strip(), key.strip()))
    return tuple(pairs)


def loads_from(args: argparse.Namespace) -> tuple[LoadSpec, ...]:
    if args.concurrency and args.request_rate:
        raise ValueError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    closed = not args.request_rate
    levels = parse_levels(args.concurrency or "1", integer=True) if closed else parse_levels(args.request_rate, False)
    if args.sweep and len(levels) == 1:
        levels = doubling_levels(levels[0], args.sweep_max)
    if closed:
        return tuple(LoadSpec(concurrency=int(level)) for level in levels)
    return tuple(LoadSpec(rate=level, arrival=args.arrival, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency) for level in levels)


def config_from(args: argparse.Namespace) -> BenchConfig:
    if not 0 < args.slo_min_fraction <= 1:
        raise ValueError(f"--slo-min-fraction must be in (0, 1], got {args.slo_min_fraction}")
    if args.dataset is not None and not Path(args.dataset).is_file():
        raise ValueError(f"--dataset {args.dataset}: no such file")
    workload = WorkloadSpec(
        kind=args.workload, input_len=args.input_len, input_dist=args.input_dist, input_spread=args.input_spread,
        output_len=args.output_len, output_dist=args.output_dist, output_spread=args.output_spread,
        num_prefix_groups=args.num_prefix_groups, prefix_len=args.prefix_len, num_turns=args.num_turns,
        path=args.dataset, priority_mix=parse_priority_mix(args.priority_mix),
        tenant_mix=parse_tenant_mix(args.tenant_mix),
    )
    return BenchConfig(
        workload=workload, loads=loads_from(args), num_requests=args.num_requests, waves=args.waves,
        warmup=args.warmup, seed=args.seed,
        slo=parse_slo(args.slo), slo_min_fraction=args.slo_min_fraction, slo_percentile=args.slo_percentile,
        options=RequestOptions(args.temperature, args.ignore_eos, args.extra_body),
        timeout_s=args.timeout, lag_tolerance_s=args.lag_tolerance_ms / 1e3,
        lag_relative=args.lag_relative,
        stop_at_saturation=not args.no_stop_at_saturation, min_gain=args.saturation_gain,
        patience=args.saturation_patience,
        use_server_tokenize=not args.no_server_tokenize, reset_prefix_cache=args.reset_prefix_cache,
        profile=args.profile,
        progress=not args.no_progress,
    )


def tokenizer_from(args: argparse.Namespace) -> ClientTokenizer | None:
    from pagoda.bench.tokens import ClientTokenizer

    path = args.tokenizer
    if path is None and args.model and (Path(args.model) / "tokenizer.json").is_file():
        path = args.model
    return ClientTokenizer(path) if path else None


async def run_all(endpoints: list[Endpoint], config: BenchConfig,
                  tokenizer: ClientTokenizer | None) -> list[dict[str, Any]]:
    from pagoda.bench.report import print_level

    return [await bench_endpoint(endpoint, config, tokenizer, on_level=lambda e, p: print_level(e.name, p))
            for endpoint in endpoints]


def command_line() -> str:
    argv = sys.argv[1:]
    return shlex.join(["pagoda", *argv] if "bench" in argv[:1] else ["pagoda", "bench", *argv])


def run(args: argparse.Namespace) -> int:
    from pagoda.bench.plots import can_plot, plot_benchmark
    from pagoda.bench.report import document, environment, render, write_json

    if not args.no_plot and not can_plot():  # said before the run, not after it
        print("pagoda bench: plots need matplotlib: pip install 'pagoda[bench]' (or pass --no-plot)", file=sys.stderr)
        return 2
    try:
        endpoints, config, tokenizer = endpoints_from(args), config_from(args), tokenizer_from(args)
    except (ValueError, OSError) as error:
        print(f"pagoda bench: {error}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the table
    started, before = time.strftime("%Y-%m-%dT%H:%M:%S%z"), environment()
    try:
        results = asyncio.run(run_all(endpoints, config, tokenizer))
    except (RuntimeError, ValueError, OSError) as error:  # OSError: a dataset that cannot be read
        print(f"pagoda bench: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(results))
    out = Path(args.out or f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    command = getattr(args, "command_line", None) or command_line()
    write_json(out, document(command, config.to_dict(), results, args.note, started, before))
    written = [str(out)]
    if not args.no_plot:
        model = results[0].get("model", "")
        per_level = f"max({args.num_requests}, {args.waves} x C)" if args.waves else str(args.num_requests)
        title = (f"{model} ({args.api}): {args.workload} {args.input_len} in / {args.output_len} out tokens, "
                 f"{per_level} requests per level")
        written.append(str(plot_benchmark(results, args.plot or out.with_suffix(".png"), title)))
    print("wrote " + ", ".join(written))
    ok = sum(p["summary"]["num_ok"] for e in results for p in e["levels"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench", description=DESCRIPTION, epilog=EXAMPLE)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if argv is not None:
        args.command_line = shlex.join(["pagoda", "bench", *argv])
    return run(args)
