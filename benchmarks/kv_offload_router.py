"""Two replicas behind `pagoda route` sharing one Redis KV store, against the same two with local tiers only.

Each conversation sends a --history-token prompt, then returns with --follow-up more tokens. The router runs
round_robin, so a conversation's return lands on the other replica: with the shared store that replica loads
the history the first one computed; without it, it computes it again. Reported per mode: the prefix-hit rate
over every prompt token the replicas looked up (their own prefix cache's hits plus the tiers' loaded tokens),
the returning turns' TTFT p50 (streamed, first chunk), and the bytes the shared tier moved per loaded token
against `pagoda calc`'s KV bytes per token (the difference is the stored blocks' headers). Writes JSON.

    python benchmarks/kv_offload_router.py --model models/bench-125m
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from kv_offload import REPOSITORY, start_redis
from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server

from pagoda.calc.formulas import kv_bytes_per_token
from pagoda.model.loader import load_model_config

MODES = ("local_only", "shared_store")


def scrape(url: str) -> dict[str, float]:
    """The replica's counters summed over label sets; the offload bytes by transfer_type."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = line.split("{")[0].split(" ")[0]
        if name == "vllm:kv_offload_total_bytes_total":
            name += "/" + line.split('transfer_type="')[1].split('"')[0]
        elif name == "pagoda:kv_offload_hit_tokens_total":
            name += "/" + line.split('medium="')[1].split('"')[0]
        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def ttft(router: str, model: str, prompt: list[int], output_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - started
    assert first is not None, "no chunk streamed"
    return first


def run_mode(mode: str, args: argparse.Namespace, store: str, work: Path) -> dict:
    extra: dict = {"cpu_bytes_to_use": int(args.offloading_gib * (1 << 30))}
    if mode == "shared_store":
        extra["shared_store"] = store
    transfer = json.dumps({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra})
    processes, replicas = [], []
    try:
        for index in range(2):
            port = free_port()
            command = [sys.executable, "-m", "pagoda", "serve", "--model", args.model, "--host", HOST, "--port",
                       str(port), "--threads", str(args.threads), "--dtype", args.dtype, "--block-size",
                       str(args.block_size), "--kv-transfer-config", transfer]
            process, url = start_server(command, work / f"{mode}-replica{index}.log", timeout=300)
            processes.append(process)
            replicas.append(url)
        command = [sys.executable, "-m", "pagoda", "route", "--policy", "round_robin", "--host", HOST, "--port",
                   str(free_port()), *[flag for url in replicas for flag in ("--replica", url)]]
        process, router = start_server(command, work / f"{mode}-router.log", timeout=120)
        processes.append(process)
        model = httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        returning = []
        for _ in range(args.conversations):
            history = [rng.randrange(10, args.vocab_limit) for _ in range(args.history)]
            ttft(router, model, history, args.output_tokens)  # round_robin: the next request goes to the other
            time.sleep(args.settle_s)  # the first replica's saves reach the store
            returning.append(ttft(router, model, history + [rng.randrange(10, args.vocab_limit)
                                                            for _ in range(args.follow_up)], args.output_tokens))
        counters = [scrape(url) for url in replicas]
    finally:
        for process in reversed(processes):
            stop_server(process)
    total = {name: sum(c.get(name, 0.0) for c in counters) for name in set().union(*counters)}
    queries = total.get("vllm:prefix_cache_queries_total", 0.0)
    hits = total.get("vllm:prefix_cache_hits_total", 0.0) + total.get("vllm:external_prefix_cache_hits_total", 0.0)
    shared_bytes = total.get("vllm:kv_offload_total_bytes_total/SHARED_to_GPU", 0.0)
    shared_tokens = shared_bytes and sum(c.get("pagoda:kv_offload_hit_tokens_total/SHARED", 0.0) for c in counters)
    return {"returning_ttft_s": returning, "returning_ttft_p50_s": statistics.median(returning),
            "prefix_hit_rate": hits / queries if queries else None,
            "external_prefix_cache_hits": total.get("vllm:external_prefix_cache_hits_total", 0.0),
            "shared_bytes_loaded": shared_bytes,
            "shared_bytes_per_loaded_token": shared_bytes / shared_tokens if shared_tokens else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--follow-up", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--offloading-gib", type=float, default=0.5)
    parser.add_argument("--vocab-limit", type=int, default=1000)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPOSITORY / "benchmarks" / "results" / "kv_offload_router.json"))
    args = parser.parse_args()
    config = load_model_config(args.model)
    work = Path(tempfile.mkdtemp(prefix="kv-offload-router-"))
    redis_process, store = start_redis(work)
    try:
        results = {mode: run_mode(mode, args, store, work) for mode in MODES}
    finally:
        redis_process.kill()
    calc = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, args.dtype)
    result = {"args": vars(args), "modes": results, "calc_kv_bytes_per_token": calc}
    for mode in MODES:
        row = results[mode]
        print(f"{mode:13s} hit rate {row['prefix_hit_rate']:.3f}  returning TTFT p50 "
              f"{1000 * row['returning_ttft_p50_s']:.1f} ms  shared bytes/loaded token "
              f"{row['shared_bytes_per_loaded_token']}")
    print(f"calc KV bytes per token: {calc}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
