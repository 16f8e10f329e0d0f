#!/usr/bin/env python
"""Resident memory of `pagoda serve` (built-in model) idle at start, and idle again after a run of hostile
requests: does the memory that bad input made the server allocate come back?

The load is what a probe sends: near-limit bodies of token ids to /detokenize, invalid JSON, lone
surrogates, wrong types, over-long prompts, /tokenize of long text, many distinct output constraints (each
compiled once), stop strings and logit_bias at their bounds. A few client threads each send --rounds of it
(a fixed amount of work, so that two trees are compared on the same requests however busy the machine);
then the script waits until the engine is idle (nothing running or waiting, KV 0) and reads the RSS again.

    python benchmarks/bad_input_rss.py --tree after=. --rounds 3
    git archive HEAD | tar -x -C /tmp/pagoda-before
    python benchmarks/bad_input_rss.py --tree before=/tmp/pagoda-before --tree after=.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
from common import environment, load_average, log, write_json
from idle_rss import STARTUP_TIMEOUT_S, rss_bytes
from server_process import free_port, start_server, stop_server

MiB = 1 << 20


def hostile_requests(rng: random.Random) -> list[tuple[str, bytes]]:
    """(path, body) pairs, one of each kind; ids and texts drawn fresh so that nothing is served from a cache."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    big_ids = json.dumps({"tokens": [rng.randrange(1 << 20) for _ in range(1_000_000)]}).encode()
    long_text = "".join(rng.choice("abcdefgh ") for _ in range(200_000))
    schema = {"type": "object", "properties": {f"k{rng.randrange(10**9)}": {"type": "integer"}}, "required": []}
    return [
        ("/detokenize", big_ids[: (7 << 20)]),  # truncated: invalid JSON at the end of 7 MiB
        ("/detokenize", big_ids),
        ("/v1/chat/completions", b'{"messages": [' + b'{"role": "user", "content": "x"},' * 200_000 + b"]"),
        ("/v1/chat/completions", json.dumps({**chat, "best_of": {}, "user": [1]}).encode()),
        ("/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "root", "content": "x"}]}).encode()),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("/v1/completions", json.dumps({"prompt": long_text * 6, "max_tokens": 1}).encode()),
        ("/v1/completions", json.dumps({"prompt": long_text[:20_000], "max_tokens": 1,
                                        "stop": [long_text[i:i + 1000] for i in range(16)],
                                        "logit_bias": {str(i): 1.0 for i in range(1024)}}).encode()),
        ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).encode()),
        ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": 1, "structured_outputs": {
            "regex": f"[a-z]{{{rng.randrange(1, 50)}}}x{rng.randrange(10**9)}"}}).encode()),
        ("/tokenize", json.dumps({"prompt": long_text}).encode()),
        ("/v1/chat/completions", "{\"messages\": []}".encode("utf-16")),
    ]


def hostile_loop(url: str, rounds: int, clients: int) -> int:
    sent, lock = [0], threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=120, headers={"content-type": "application/json"}) as http:
            for _ in range(rounds):
                for path, body in hostile_requests(rng):
                    with contextlib.suppress(httpx.HTTPError):
                        http.post(path, content=body)
                    with lock:
                        sent[0] += 1

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sent[0]


def wait_idle(url: str, timeout: float = 60.0) -> None:
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(wanted)]
        if values and not any(values):
            return
        time.sleep(0.5)
    raise RuntimeError("the engine did not become idle")


def measure(tree: Path, rounds: int, clients: int, settle_s: float, log_dir: Path) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "pagoda", "serve", "--port", str(port)]
    env = {"PYTHONPATH": str(tree.resolve() / "src")}
    process, url = start_server(command, log_dir / f"serve-{port}.log", STARTUP_TIMEOUT_S, env=env)
    try:
        time.sleep(settle_s)
        at_start = rss_bytes(process.pid)
        sent = hostile_loop(url, rounds, clients)
        peak = rss_bytes(process.pid)
        wait_idle(url)
        time.sleep(settle_s)
        after = rss_bytes(process.pid)
    finally:
        stop_server(process)
    return {"requests": sent, "rss_start_mib": at_start / MiB, "rss_end_of_load_mib": peak / MiB,
            "rss_idle_after_mib": after / MiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH",
                        help="a pagoda source tree to serve from (repeat to compare)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every hostile request, per client")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before each RSS reading")
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--out", default="benchmarks/results/bad_input_rss.json")
    args = parser.parse_args()
    load_at_start = load_average()
    results = {}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        results[label] = {"tree": path, **measure(Path(path), args.rounds, args.clients, args.settle,
                                                   Path(args.log_dir))}
        log(f"{label}: {results[label]}")
    print(f"\n{'tree':<10} {'requests':>9} {'idle at start':>14} {'end of load':>12} {'idle after':>11}  (MiB)")
    for label, r in results.items():
        print(f"{label:<10} {r['requests']:>9} {r['rss_start_mib']:>14.0f} {r['rss_end_of_load_mib']:>12.0f} "
              f"{r['rss_idle_after_mib']:>11.0f}")
    write_json(args.out, {"benchmark": "bad_input_rss", "rounds": args.rounds, "clients": args.clients,
                          "results": results, "environment": environment(load_at_start)})


if __name__ == "__main__":
    main()
