"""Soak `pagoda serve`: long, open-loop load past saturation, with disconnects and hostile requests mixed in.

    .venv/bin/python benchmarks/soak.py                        # calibrate, then 0.5x, 1x, then 2x for 20 min
    .venv/bin/python benchmarks/soak.py --minutes 2 --json /tmp/soak.json   # a quick trial
    .venv/bin/python benchmarks/soak.py --levels 2 --minutes 1 --requests 300 --calibrate-seconds 10 \
        --rss-period 1 --json /tmp/soak-smoke.json                           # a smoke run

First a closed-loop calibration finds the server's saturation rate (completed requests per second with
--max-num-seqs clients always busy), and a warm-up sends each kind of request once. Then Poisson arrivals at
each multiple of that rate in --levels, the last one for --minutes. Requests mix prompt lengths and output
lengths, streaming and not; a share is dropped by the client mid-flight, and a share is hostile: each of the
cases in soak_requests.HOSTILE, which must get a 4xx, and each hostile family of grammar_poisons.py (output
constraints built to hurt the grammar engine), which must get a 4xx or fail alone (a 5xx or error event the
server marks as confined to it), while every ordinary request beside it completes.
--requests caps each level's requests, for a short trial.

Checked, and the exit code is 1 when any fails:
- no response has a 5xx status, every error body is OpenAI's shape;
- every completed response's `usage.completion_tokens` equals the tokens it carried (`logprobs` lists one
  entry per token, in the stream and out of it);
- resident memory of the server is flat after warm-up: the last quarter's median within 5% of the median of
  the second quarter of the long level (sampled every few seconds; plotted);
- once the load stops, no request is running or waiting and KV usage is 0 (no block leaked);
- idle resident memory after the run (nothing in flight, settled) within 10% of idle after the warm-up.
Reported per level: offered and completed rate, 429 share, TTFT p50/p99 of streamed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server
from soak_requests import Level, ordinary_body, send_hostile, send_ordinary, warm_up

# Idle resident memory after the run may exceed idle after warm-up by at most this factor.
IDLE_RSS_GROWTH_LIMIT = 1.10

async def run_level(url: str, model: str, level: Level, seed: int, args) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        tasks: set[asyncio.Task] = set()
        started, sent = time.monotonic(), 0
        while time.monotonic() < started + level.seconds and sent < args.requests:
            sent += 1
            await asyncio.sleep(rng.expovariate(level.rate))
            if rng.random() < args.hostile_share:
                coroutine = send_hostile(client, rng, model, level)
            else:
                drop = rng.uniform(0.05, 2.0) if rng.random() < args.disconnect_share else None
                coroutine = send_ordinary(client, ordinary_body(rng, model), level, drop)
            task = asyncio.create_task(coroutine)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        level.seconds = time.monotonic() - started  # shorter than planned when --requests ran out first
        await asyncio.gather(*tasks)


async def calibrate(url: str, model: str, clients: int, seconds: float) -> float:
    """Completed requests per second with `clients` requests always in flight (no disconnects)."""
    level = Level(0, 0, seconds)
    rng = random.Random(1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                await send_ordinary(client, ordinary_body(rng, model), level, None)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return level.completed / (time.monotonic() - started)


class RssSampler:
    """The server's resident memory every `period` seconds, from /proc."""

    def __init__(self, pid: int, period: float) -> None:
        self.pid, self.period, self.samples = pid, period, []

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    async def run(self, began: float, label: str) -> None:
        while True:
            self.samples.append((time.monotonic() - began, label, self.rss_mib()))
            await asyncio.sleep(self.period)


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or
              line.startswith(name + " ")]
    return sum(values)


async def idle_rss_mib(url: str, sampler: RssSampler, settle_s: float) -> float:
    """The server's RSS once nothing is running or waiting and it has had settle_s to give memory back."""
    while await metric(url, "vllm:num_requests_running") + await metric(url, "vllm:num_requests_waiting"):
        await asyncio.sleep(0.5)
    await asyncio.sleep(settle_s)
    return sampler.rss_mib()


async def soak(url: str, pid: int, model: str, args) -> dict:
    print(f"calibrating for {args.calibrate_seconds:.0f} s with {args.max_num_seqs} clients ...", flush=True)
    saturation = await calibrate(url, model, args.max_num_seqs, args.calibrate_seconds)
    print(f"saturation: {saturation:.2f} requests/s", flush=True)
    warm = await warm_up(url, model)
    print(f"warm-up: every kind of request once ({sum(warm.statuses.values())} sent)", flush=True)
    sampler, began = RssSampler(pid, args.rss_period), time.monotonic()
    idle_after_warmup = await idle_rss_mib(url, sampler, args.idle_settle_seconds)  # the calibration warmed it up
    print(f"idle RSS after warm-up: {idle_after_warmup:.0f} MiB", flush=True)
    levels = []
    for index, multiple in enumerate(args.levels):
        seconds = args.minutes * 60 if index == len(args.levels) - 1 else args.short_seconds
        level = Level(multiple, multiple * saturation, seconds)
        sampling = asyncio.create_task(sampler.run(began, f"{multiple}x"))
        await run_level(url, model, level, seed=100 + index, args=args)
        sampling.cancel()
        levels.append(level.report())
        print(json.dumps({k: v for k, v in levels[-1].items() if k != "problems"}), flush=True)
        for problem in level.problems[:10]:
            print("   problem:", problem, flush=True)
    await asyncio.sleep(2)  # let aborted requests drain
    leftover = {name: await metric(url, name) for name in
                ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    idle_after_run = await idle_rss_mib(url, sampler, args.idle_settle_seconds)
    print(f"idle RSS after the run: {idle_after_run:.0f} MiB", flush=True)
    rss = [{"t_s": round(t, 1), "level": label, "rss_mib": round(mib, 1)} for t, label, mib in sampler.samples]
    return {"saturation_rps": round(saturation, 3), "warm_up_problems": warm.problems, "levels": levels,
            "after": leftover, "rss": rss,
            "idle_rss_mib": {"after_warmup": round(idle_after_warmup, 1), "after_run": round(idle_after_run, 1)}}


def verdict(result: dict) -> list[str]:
    failures = [f"warm-up: {problem}" for problem in result["warm_up_problems"]]
    failures += [f"{level['multiple']}x: {problem}" for level in result["levels"] for problem in level["problems"]]
    failures += [f"{name} = {value} after the load" for name, value in result["after"].items() if value != 0]
    idle = result["idle_rss_mib"]
    if idle["after_run"] > IDLE_RSS_GROWTH_LIMIT * idle["after_warmup"]:
        failures.append(f"idle RSS {idle['after_run']:.0f} MiB after the run, {idle['after_warmup']:.0f} MiB after "
                        f"warm-up: more than {IDLE_RSS_GROWTH_LIMIT - 1:.0%} above")
    long = [s["rss_mib"] for s in result["rss"] if s["level"] == result["rss"][-1]["level"]]
    quarter = len(long) // 4
    if quarter >= 2:
        warm, last = statistics.median(long[quarter:2 * quarter]), statistics.median(long[-quarter:])
        result["rss_drift"] = round(last / warm - 1, 4)
        if abs(last / warm - 1) > 0.05:
            failures.append(f"RSS drifted {100 * (last / warm - 1):+.1f}% ({warm:.0f} -> {last:.0f} MiB)")
    else:
        failures.append("too few RSS samples in the long level to judge drift")
    return failures


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    for label in dict.fromkeys(s["level"] for s in result["rss"]):
        points = [s for s in result["rss"] if s["level"] == label]
        axis.plot([s["t_s"] / 60 for s in points], [s["rss_mib"] for s in points], label=f"offered {label}")
    axis.set(xlabel="minutes", ylabel="server RSS (MiB)", title="pagoda serve under soak")
    axis.set_ylim(bottom=0)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the built-in model)")
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the last (longest) level")
    parser.add_argument("--levels", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="offered load as multiples of the calibrated saturation rate; the last is the soak")
    parser.add_argument("--short-seconds", type=float, default=90.0, help="length of each level but the last")
    parser.add_argument("--calibrate-seconds", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-waiting-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1 << 62, help="at most this many requests per level")
    parser.add_argument("--hostile-share", type=float, default=0.05)
    parser.add_argument("--disconnect-share", type=float, default=0.1)
    parser.add_argument("--rss-period", type=float, default=5.0)
    parser.add_argument("--idle-settle-seconds", type=float, default=10.0,
                        help="idle time before idle RSS is read (the server gives memory back after 2 s idle)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args()

    command = [sys.executable, "-m", "pagoda", "serve", "--host", HOST, "--port", str(free_port()),
               "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", str(args.max_waiting_requests),
               "--max-model-len", "512", "--threads", str(args.threads), "--uvicorn-log-level", "warning",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # tool_choice auto among the poisons
    command += ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory(prefix="pagoda-soak-") as log_dir:
        process, url = start_server(command, Path(log_dir) / "server.log", timeout=300)
        try:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            result = asyncio.run(soak(url, process.pid, model, args))
        finally:
            exit_code = stop_server(process)
            tracebacks = Path(log_dir, "server.log").read_text(errors="replace").count("Traceback")
    result.update(command=" ".join(["pagoda", *command[3:]]), server_exit_code=exit_code,
                  server_log_tracebacks=tracebacks, args={k: str(v) for k, v in vars(args).items()})
    failures = verdict(result) + ([f"{tracebacks} tracebacks in the server log"] if tracebacks else [])
    result["failures"] = failures
    write_result(args.json, result, indent=1)
    plot(result, args.json.with_suffix(".png"))
    print(f"\n{len(failures)} failures; wrote {args.json} and {args.json.with_suffix('.png')}")
    for failure in failures[:30]:
        print("  ", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
