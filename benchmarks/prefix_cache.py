"""Prefix caching through the real server: a shared system prompt, with caching on vs off, in one run.

Default workload: 32 requests, each a 1,024-token system prompt shared by all plus a distinct
question of ~64 tokens (60-68), 64 output tokens (ignore_eos, greedy), sent as token ids to
/v1/completions (streamed) by 8 concurrent clients. The same workload goes to two `pagoda serve`
subprocesses started one after the other: one with prefix caching, one with --no-enable-prefix-caching.
Each server gets one unrelated warm-up request first; nothing of the system prompt is cached in advance.

Reported per server: TTFT (client side: request sent -> first streamed token) p50/p90, total token
throughput ((prompt + output tokens) / wall time of the whole workload), output throughput, and the
cached tokens the server reported. The figures of merit are the ratios on/off (targets: TTFT p50 <= 0.2x,
total throughput >= 2x). Prints a table and writes JSON.

    python benchmarks/prefix_cache.py --model models/bench-125m [--max-model-len 2048] [--kv-cache-memory-bytes 2G]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server


@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


def make_workload(num_requests: int, system_len: int, question_len: int, vocab_size: int, seed: int):
    """One shared system prompt, distinct questions of question_len +- 4 tokens (ids clear of specials)."""
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab_size) for _ in range(system_len)]
    prompts = []
    for _ in range(num_requests):
        length = rng.randint(question_len - 4, question_len + 4)
        prompts.append(system + [rng.randrange(10, vocab_size) for _ in range(length)])
    return prompts


def start_pagoda(args, caching: bool, log_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    command = [sys.executable, "-m", "pagoda", "serve", "--model", args.model, "--host", HOST,
               "--port", str(free_port()), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--uvicorn-log-level", "warning",
               "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    log_path = log_dir / f"server-{'on' if caching else 'off'}.log"
    process, url = start_server(command, log_path, args.startup_timeout, env)
    return process, url, log_path


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first_token = None
    output_tokens = cached = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and first_token is None:
                first_token = time.perf_counter()
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    finished = time.perf_counter()
    assert output_tokens == output_len, f"{output_tokens} output tokens, wanted {output_len}"
    return RequestResult(first_token - started, finished - started, len(prompt), output_tokens, cached)


async def run_workload(url: str, prompts: list[list[int]], output_len: int, concurrency: int):
    """`concurrency` clients, each taking the next prompt as soon as its previous request finished."""
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    results: list[RequestResult | None] = [None] * len(prompts)
    timeout = httpx.Timeout(3600.0, connect=30.0)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                index, prompt = queue.get_nowait()
                results[index] = await one_request(client, prompt, output_len)
                print(f"  request {index + 1:2d}/{len(prompts)}: TTFT {results[index].ttft_s:7.2f} s, "
                      f"cached {results[index].cached_tokens}", flush=True)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
    return results, duration


def prefix_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    values = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ttfts = [r.ttft_s for r in results]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "duration_s": duration,
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "ttft_mean_s": statistics.fmean(ttfts),
        "e2e_p50_s": percentile([r.e2e_s for r in results], 0.5),
        "total_tokens_per_s": (prompt_tokens + output_tokens) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "requests_per_s": len(results) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/bench-125m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", default="2G")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the servers")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temporary directory)")
    args = parser.parse_args()

    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_workload(args.num_requests, args.system_len, args.question_len, vocab_size, args.seed)
    warm_up = make_workload(1, 0, args.question_len, vocab_size, args.seed + 1)[0]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pagoda-prefix-bench-") as temporary_dir:
        log_dir = args.log_dir or temporary_dir
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        for label, caching in (("on", True), ("off", False)):
            print(f"prefix caching {label}: starting the server", flush=True)
            process, url, log_path = start_pagoda(args, caching, Path(log_dir))
            try:
                asyncio.run(run_workload(url, [warm_up], 4, 1))
                before = prefix_counters(url)
                results, duration = asyncio.run(run_workload(url, prompts, args.output_len, args.concurrency))
                time.sleep(1.0)  # the engine publishes its counters after the step (or within 0.5 s idle)
                after = prefix_counters(url)
            except BaseException:
                print(log_path.read_text()[-3000:], file=sys.stderr)
                raise
            finally:
                stop_server(process)
            runs[label] = summarize(results, duration)
            runs[label]["prefix_cache_hits"] = after["vllm:prefix_cache_hits_total"] - before[
                "vllm:prefix_cache_hits_total"]
            runs[label]["prefix_cache_queries"] = after["vllm:prefix_cache_queries_total"] - before[
                "vllm:prefix_cache_queries_total"]
            runs[label]["requests"] = [asdict(r) for r in results]

    on, off = runs["on"], runs["off"]
    ratios = {
        "ttft_p50_on_over_off": on["ttft_p50_s"] / off["ttft_p50_s"],
        "total_throughput_on_over_off": on["total_tokens_per_s"] / off["total_tokens_per_s"],
        "output_throughput_on_over_off": on["output_tokens_per_s"] / off["output_tokens_per_s"],
    }
    targets = {"ttft_p50_on_over_off_at_most": 0.2, "total_throughput_on_over_off_at_least": 2.0}
    met = {
        "ttft": ratios["ttft_p50_on_over_off"] <= targets["ttft_p50_on_over_off_at_most"],
        "throughput": ratios["total_throughput_on_over_off"] >= targets["total_throughput_on_over_off_at_least"],
    }

    print()
    print(f"{'':24s} {'caching on':>12s} {'caching off':>12s} {'on / off':>10s}")
    rows = [("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p90 (s)", "ttft_p90_s"), ("E2E p50 (s)", "e2e_p50_s"),
            ("total tokens/s", "total_tokens_per_s"), ("output tokens/s", "output_tokens_per_s"),
            ("duration (s)", "duration_s"), ("cached prompt tokens", "cached_tokens")]
    for name, key in rows:
        ratio = on[key] / off[key] if off[key] else float("nan")
        print(f"{name:24s} {on[key]:12.2f} {off[key]:12.2f} {ratio:10.3f}")
    print(f"targets: TTFT p50 on/off <= 0.2 ({'met' if met['ttft'] else 'NOT met'}), "
          f"total throughput on/off >= 2 ({'met' if met['throughput'] else 'NOT met'})")

    try:
        import torch

        torch_version, threads = torch.__version__, args.threads or torch.get_num_threads()
    except ImportError:
        torch_version, threads = None, args.threads
    report = {
        "workload": {key: value for key, value in vars(args).items()},
        "environment": {"torch": torch_version, "threads": threads, "cpu_count": os.cpu_count(),
                        "machine": platform.machine(), "load_average": os.getloadavg()},
        "caching_on": on,
        "caching_off": off,
        "ratios": ratios,
        "targets": targets,
        "targets_met": met,
    }
    write_result(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
