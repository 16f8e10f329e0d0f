"""The fairness soak: one tenant flooding at 10x its requests-per-minute limit beside two tenants within theirs.

Starts `pagoda serve --tenant-config` (or `--data-parallel-size N`), then runs three phases of `--duration`
seconds, each an open loop of Poisson arrivals of streamed completions: each well-behaved tenant alone (its
solo TTFT), then all three together. It reports the flooder's 429s, each well-behaved tenant's TTFT p99 in the
mix over its solo p99 (the bar: 1.5x), and the generated-token shares of the two against their weights' shares
(the bar: within 10%; meaningful when their demand saturates the engine, which --rate must make it), and
writes JSON and a plot.

    python benchmarks/tenant_fairness.py --model models/bench-125m --duration 120 --rate 40 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
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
    tokens: int


def tenants_file(rate_per_min: int) -> dict:
    """Each tenant may send `rate_per_min` requests a minute; the flooder will send ten times that."""
    return {"tenants": {name: {"api_keys": [f"sk-{name}"], "requests_per_minute": rate_per_min, "weight": weight}
                        for name, weight in WEIGHTS.items()}}


async def one_request(client: httpx.AsyncClient, tenant: str, prompt: str, max_tokens: int) -> Outcome:
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
                    ttft = ttft if ttft is not None else time.monotonic() - start
                    tokens += 1
            return Outcome(tenant, 200, ttft, tokens)
    except httpx.HTTPError:
        return Outcome(tenant, 0, None, 0)


async def open_loop(client: httpx.AsyncClient, tenant: str, per_minute: float, duration: float, max_tokens: int,
                    rng: random.Random) -> list[Outcome]:
    tasks, deadline = [], time.monotonic() + duration
    while time.monotonic() < deadline:
        prompt = " ".join(rng.choice(["river", "stone", "cloud", "lantern", "harbor", "meadow"]) for _ in range(24))
        tasks.append(asyncio.create_task(one_request(client, tenant, prompt, max_tokens)))
        await asyncio.sleep(rng.expovariate(per_minute / 60.0))
    return list(await asyncio.gather(*tasks))


async def phase(url: str, demand: dict[str, float], duration: float, max_tokens: int, seed: int) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        runs = [open_loop(client, tenant, per_minute, duration, max_tokens, random.Random(seed + i))
                for i, (tenant, per_minute) in enumerate(demand.items())]
        return [outcome for outcomes in await asyncio.gather(*runs) for outcome in outcomes]


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def summarize(solo: dict[str, list[Outcome]], mixed: list[Outcome]) -> dict:
    report: dict = {"flood": {"sent": sum(o.tenant == "flood" for o in mixed),
                              "refused_429": sum(o.tenant == "flood" and o.status == 429 for o in mixed)}}
    tokens = {name: sum(o.tokens for o in mixed if o.tenant == name) for name in ("alice", "bob")}
    total_weight = WEIGHTS["alice"] + WEIGHTS["bob"]
    for name in ("alice", "bob"):
        solo_p99 = p99([o.ttft_s for o in solo[name] if o.ttft_s is not None])
        mixed_p99 = p99([o.ttft_s for o in mixed if o.tenant == name and o.ttft_s is not None])
        share = tokens[name] / sum(tokens.values()) if sum(tokens.values()) else None
        report[name] = {
            "solo_ttft_p99_s": solo_p99, "mixed_ttft_p99_s": mixed_p99,
            "ttft_p99_ratio": mixed_p99 / solo_p99 if solo_p99 and mixed_p99 else None,
            "refused_429": sum(o.tenant == name and o.status == 429 for o in mixed),
            "token_share": share, "weight_share": WEIGHTS[name] / total_weight,
        }
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["alice", "bob"]
    fig, (ttft, share) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(names))
    ttft.bar([i - 0.2 for i in x], [report[n]["solo_ttft_p99_s"] or 0 for n in names], 0.4, label="solo")
    ttft.bar([i + 0.2 for i in x], [report[n]["mixed_ttft_p99_s"] or 0 for n in names], 0.4, label="beside the flood")
    ttft.set_xticks(list(x), names)
    ttft.set_ylabel("TTFT p99 (s)")
    ttft.legend()
    share.bar([i - 0.2 for i in x], [report[n]["weight_share"] for n in names], 0.4, label="weight share")
    share.bar([i + 0.2 for i in x], [report[n]["token_share"] or 0 for n in names], 0.4, label="token share")
    share.set_xticks(list(x), names)
    share.legend()
    fig.suptitle(f"flooder: {report['flood']['refused_429']} of {report['flood']['sent']} requests refused (429)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--rate", type=int, default=40, help="each tenant's requests-per-minute limit, and the "
                                                             "well-behaved tenants' demand; the flooder sends 10x")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per phase")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tenant_fairness"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.out / "tenants.json"
    tenants = json.dumps(tenants_file(args.rate))  # the server's input, not a result
    config.write_text(tenants)
    command = [sys.executable, "-m", "pagoda", "serve", "--port", str(free_port()), "--tenant-config", str(config)]
    command += ["--model", args.model] if args.model else []
    command += ["--data-parallel-size", str(args.data_parallel_size)] if args.data_parallel_size > 1 else []
    command += ["--threads", str(args.threads)] if args.threads else []
    process, url = start_server(command, args.out / "server.log", timeout=600)
    try:
        # Within its limit, a tenant's demand: 0.9x the limit, so its own bucket never refuses it.
        within = 0.9 * args.rate
        solo = {name: asyncio.run(phase(url, {name: within}, args.duration, args.max_tokens, args.seed))
                for name in ("alice", "bob")}
        time.sleep(60.0 * 2 / args.rate)  # let the buckets the solo runs drew on refill a little
        mixed = asyncio.run(phase(url, {"flood": 10.0 * args.rate, "alice": within, "bob": within}, args.duration,
                                  args.max_tokens, args.seed + 100))
    finally:
        stop_server(process)
    report = summarize(solo, mixed)
    report["settings"] = {k: str(v) for k, v in vars(args).items()}
    write_result(args.out / "tenant_fairness.json", {"report": report, "mixed": [asdict(o) for o in mixed]}, indent=1)
    plot(report, args.out / "tenant_fairness.png")
    print(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
