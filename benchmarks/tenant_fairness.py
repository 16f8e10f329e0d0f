"""The fairness soak: one tenant flooding at 10x its requests-per-minute limit beside two tenants within theirs.

Starts `pagoda serve --tenant-config` (or `--data-parallel-size N`), then runs four phases of `--duration`
seconds. Three are open loops of Poisson arrivals of streamed completions: each well-behaved tenant alone (its
solo TTFT), then all three together, the third flooding. They report the flooder's 429s and each well-behaved
tenant's TTFT p99 beside the flood over its solo p99 (the bar: 1.5x). Fair queuing divides the engine by weight
only among tenants whose demand exceeds what it can give them, so the last phase makes all three saturate it:
each keeps `--saturate-streams` requests in flight, more than the engine runs at once, and their shares of the
tokens generated in the phase are set against their weights' shares (the bar: within 10%). Each tenant is its own
client with its own connections, as separate customers would be: a shared pool would queue one tenant's requests
behind another's before the server sees them. Writes JSON and a plot.

    python benchmarks/tenant_fairness.py --model models/bench-125m --duration 120 --rate 40 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from provenance import write_result
from server_process import free_port, start_server, stop_server

WEIGHTS = {"flood": 1.0, "alice": 2.0, "bob": 1.0}


@dataclass
class Outcome:
    tenant: str
    status: int
    ttft_s: float | None
    tokens: int  # generated inside the phase's counting window


def tenants_file(rate_per_min: int, burst: int | None) -> dict:
    """Each tenant may send `rate_per_min` requests a minute, `burst` of them at once (None: a minute's worth); the
    flooder will send ten times that."""
    limits = {"requests_per_minute": rate_per_min, **({"request_burst": burst} if burst else {})}
    return {"tenants": {name: {"api_keys": [f"sk-{name}"], **limits, "weight": weight}
                        for name, weight in WEIGHTS.items()}}


def tenant_client(url: str) -> httpx.AsyncClient:
    """One tenant's client: its own connections, as many as its requests in flight."""
    return httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None,
                                                                          max_keepalive_connections=None))


async def one_request(client: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int,
                      window: tuple[float, float] = (0.0, float("inf"))) -> Outcome:
    start = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer sk-{tenant}"}) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(tenant, response.status_code, None, 0)
            ttft, tokens = None, 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    ttft = ttft if ttft is not None else now - start
                    tokens += window[0] <= now < window[1]
            return Outcome(tenant, 200, ttft, tokens)
    except httpx.HTTPError:
        return Outcome(tenant, 0, None, 0)


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(["river", "stone", "cloud", "lantern", "harbor", "meadow"]) for _ in range(24))


async def open_loop(url: str, tenant: str, per_minute: float, duration: float, max_tokens: int,
                    rng: random.Random) -> list[Outcome]:
    """Poisson arrivals at `per_minute` for `duration` seconds; every answer awaited to its end."""
    async with tenant_client(url) as client:
        tasks, deadline = [], time.monotonic() + duration
        while time.monotonic() < deadline:
            tasks.append(asyncio.create_task(one_request(client, tenant, random_prompt(rng), max_tokens)))
            await asyncio.sleep(rng.expovariate(per_minute / 60.0))
        return list(await asyncio.gather(*tasks))


async def closed_loop(url: str, tenant: str, streams: int, duration: float, max_tokens: int,
                      rng: random.Random) -> list[Outcome]:
    """`streams` requests in flight until `duration` seconds have passed; tokens counted from a quarter of the
    way in (once the running batch has turned over since every stream started at once) up to the end."""
    start = time.monotonic()
    deadline = start + duration
    window = (start + duration / 4, deadline)

    async def stream() -> list[Outcome]:
        outcomes = []
        while time.monotonic() < deadline:
            outcomes.append(await one_request(client, tenant, random_prompt(rng), max_tokens, window))
            if outcomes[-1].status == 429:  # over its burst: back off as the openai client does
                await asyncio.sleep(1.0)
        return outcomes

    async with tenant_client(url) as client:
        return [o for outcomes in await asyncio.gather(*(stream() for _ in range(streams))) for o in outcomes]


def _open_loop_process(url: str, tenant: str, per_minute: float, duration: float, max_tokens: int,
                       seed: int) -> list[Outcome]:
    return asyncio.run(open_loop(url, tenant, per_minute, duration, max_tokens, random.Random(seed)))


def _closed_loop_process(url: str, tenant: str, streams: int, duration: float, max_tokens: int,
                         seed: int) -> list[Outcome]:
    return asyncio.run(closed_loop(url, tenant, streams, duration, max_tokens, random.Random(seed)))


def in_processes(calls: list[tuple]) -> list[Outcome]:
    """Each tenant's loop in a process of its own, as separate customers' clients are: in one event loop, the
    flooder's thousands of requests would delay the others' clients before the server is involved."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(*call) for call in calls]
        return [outcome for future in futures for outcome in future.result()]


def phase(url: str, demand: dict[str, float], duration: float, max_tokens: int, seed: int) -> list[Outcome]:
    return in_processes([(_open_loop_process, url, tenant, per_minute, duration, max_tokens, seed + i)
                         for i, (tenant, per_minute) in enumerate(demand.items())])


def saturate(url: str, streams: int, duration: float, max_tokens: int, seed: int) -> list[Outcome]:
    return in_processes([(_closed_loop_process, url, tenant, streams, duration, max_tokens, seed + i)
                         for i, tenant in enumerate(WEIGHTS)])


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def summarize(solo: dict[str, list[Outcome]], mixed: list[Outcome], saturated: list[Outcome], rate: int,
              burst: int, duration: float) -> dict:
    flood = [o for o in mixed if o.tenant == "flood"]
    report: dict = {"flood": {
        "sent": len(flood), "refused_429": sum(o.status == 429 for o in flood),
        "served": sum(o.status == 200 for o in flood),
        # a full bucket and its refill over the phase
        "admissible": int(burst + rate * duration / 60.0)}}
    for name in ("alice", "bob"):
        solo_p99 = p99([o.ttft_s for o in solo[name] if o.ttft_s is not None])
        mixed_p99 = p99([o.ttft_s for o in mixed if o.tenant == name and o.ttft_s is not None])
        report[name] = {
            "solo_ttft_p99_s": solo_p99, "mixed_ttft_p99_s": mixed_p99,
            "ttft_p99_ratio": mixed_p99 / solo_p99 if solo_p99 and mixed_p99 else None,
            "refused_429": sum(o.tenant == name and o.status == 429 for o in mixed),
        }
    tokens = {name: sum(o.tokens for o in saturated if o.tenant == name) for name in WEIGHTS}
    total_weight, total_tokens = sum(WEIGHTS.values()), sum(tokens.values())
    report["saturated"] = {"tokens_per_s": total_tokens / (duration * 3 / 4),
                           "refused_429": sum(o.status == 429 for o in saturated)}
    for name, weight in WEIGHTS.items():
        share = tokens[name] / total_tokens if total_tokens else 0.0
        report["saturated"][name] = {"token_share": share, "weight_share": weight / total_weight,
                                     "share_ratio": share * total_weight / weight}
    report["bars"] = {
        "flooder_refused": report["flood"]["refused_429"] > 0
        and report["flood"]["served"] <= report["flood"]["admissible"],
        "ttft_p99_within_1.5x": all((report[n]["ttft_p99_ratio"] or float("inf")) <= 1.5 for n in ("alice", "bob")),
        "shares_within_10pct": all(abs(report["saturated"][n]["share_ratio"] - 1.0) <= 0.1 for n in WEIGHTS),
    }
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, door, share) = plt.subplots(1, 3, figsize=(13, 3.6))
    names = ["alice", "bob"]
    x = range(len(names))
    ttft.bar([i - 0.2 for i in x], [report[n]["solo_ttft_p99_s"] or 0 for n in names], 0.4, label="alone")
    ttft.bar([i + 0.2 for i in x], [report[n]["mixed_ttft_p99_s"] or 0 for n in names], 0.4, label="beside the flood")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT p99 (s)")
    ttft.set_title("well-behaved tenants' TTFT")
    ttft.legend()
    flood = report["flood"]
    door.bar(["sent", "refused (429)", "served", "limit allows"],
             [flood["sent"], flood["refused_429"], flood["served"], flood["admissible"]])
    door.set_title("the flooder, at 10x its limit")
    everyone = list(WEIGHTS)
    x = range(len(everyone))
    sat = report["saturated"]
    share.bar([i - 0.2 for i in x], [sat[n]["weight_share"] for n in everyone], 0.4, label="weight share")
    share.bar([i + 0.2 for i in x], [sat[n]["token_share"] for n in everyone], 0.4, label="token share")
    share.set_xticks(list(x), everyone)
    share.set_title(f"all saturating: {sat['tokens_per_s']:.0f} tokens/s")
    share.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--rate", type=int, default=40, help="each tenant's requests-per-minute limit, and the "
                                                             "well-behaved tenants' demand; the flooder sends 10x")
    parser.add_argument("--request-burst", type=int, default=None,
                        help="each tenant's request_burst: requests admitted at once (default: a minute's worth)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32,
                        help="the server's running batch: fair queuing orders who joins it, so beyond it requests "
                             "wait their tenant's turn; with room for all, a burst joins at once")
    parser.add_argument("--saturate-streams", type=int, default=24,
                        help="requests each tenant keeps in flight in the last phase (more than --max-num-seqs "
                             "together)")
    parser.add_argument("--saturate-max-tokens", type=int, default=256,
                        help="their length: long enough that a tenant's requests stay within its --rate")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tenant_fairness"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.out / "tenants.json"
    tenants = json.dumps(tenants_file(args.rate, args.request_burst))  # the server's input, not a result
    config.write_text(tenants)
    command = [sys.executable, "-m", "pagoda", "serve", "--port", str(free_port()), "--tenant-config", str(config)]
    command += ["--max-num-seqs", str(args.max_num_seqs)]
    command += ["--model", args.model] if args.model else []
    command += ["--data-parallel-size", str(args.data_parallel_size)] if args.data_parallel_size > 1 else []
    command += ["--threads", str(args.threads)] if args.threads else []
    process, url = start_server(command, args.out / "server.log", timeout=600)
    try:
        # Within its limit, a tenant's demand: 0.9x the limit, so its own bucket never refuses it.
        within = 0.9 * args.rate
        saturate(url, 2, 10.0, args.max_tokens, args.seed - 1)  # warm-up: the first steps are slow
        time.sleep(60.0)  # the buckets it drew on refill
        solo = {}
        for name in ("alice", "bob"):
            print(f"{name} alone for {args.duration:.0f} s", flush=True)
            solo[name] = phase(url, {name: within}, args.duration, args.max_tokens, args.seed)
        time.sleep(60.0)  # the buckets the solo runs drew on refill
        print(f"all three, flood at {10 * args.rate}/min, for {args.duration:.0f} s", flush=True)
        mixed = phase(url, {"flood": 10.0 * args.rate, "alice": within, "bob": within}, args.duration,
                      args.max_tokens, args.seed + 100)
        time.sleep(60.0)
        print(f"all three saturating, {args.saturate_streams} streams each, for {args.duration:.0f} s", flush=True)
        saturated = saturate(url, args.saturate_streams, args.duration, args.saturate_max_tokens, args.seed + 200)
    finally:
        stop_server(process)
    report = summarize(solo, mixed, saturated, args.rate, args.request_burst or args.rate, args.duration)
    report["settings"] = {k: str(v) for k, v in vars(args).items()}
    write_result(args.out / "tenant_fairness.json", {"report": report, "mixed": [asdict(o) for o in mixed]}, indent=1)
    plot(report, args.out / "tenant_fairness.png")
    print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
