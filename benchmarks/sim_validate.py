"""Validates `pagoda sim` against a real fleet on the same trace: N `pagoda serve` replicas behind `pagoda route`,
the trace replayed through the router with the official openai client (streaming /v1/completions with the
trace's token ids, ignore_eos, each conversation's turns in order, a think time after each answer), then the same
trace, engine settings and router settings simulated with a calibrated step-cost model.

Compared: the replicas' prefix-cache hit rate (vllm:prefix_cache_hits / queries, summed over replicas; target:
within 0.05) and TTFT p50 (target: within 20%). Calibrate first, with the replicas' thread count:

    python benchmarks/sim_calibrate.py --model models/bench-125m --threads 1 --out /tmp/step_cost.json
    python benchmarks/sim_validate.py --model models/bench-125m --step-cost /tmp/step_cost.json --replicas 3

--quick: 2 replicas, a handful of conversations (a check that the script works; its figures mean little).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY / "src"))

from pagoda.config import SchedulerConfig  # noqa: E402
from pagoda.router.config import RouterConfig  # noqa: E402
from pagoda.sim.fleet import simulate  # noqa: E402
from pagoda.sim.replica import ReplicaConfig  # noqa: E402
from pagoda.sim.report import percentile, summarize  # noqa: E402
from pagoda.sim.step_cost import DEFAULT_STEP_COST, StepCost, StepShape  # noqa: E402
from pagoda.sim.trace import Trace, TraceConfig, generate_trace  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sim_validation.json"
PROBE_TOKENS = 16


def scrape(url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    values = dict.fromkeys(wanted, 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
    return values


async def serving_overhead(router_url: str, cost: StepCost, vocab_size: int, probes: int = 8) -> float:
    """The serving path's time outside engine steps, on the idle fleet: the median TTFT of one-token requests
    (fresh 16-token prompts, one at a time) less the step the cost model predicts for such a prompt."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=60)
    model = (await client.models.list()).data[0].id
    rng = random.Random(1234)
    ttfts = []
    for _ in range(probes):
        prompt = [rng.randrange(16, vocab_size) for _ in range(PROBE_TOKENS)]
        sent = time.perf_counter()
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                                 stream=True)
        first = None
        async for _chunk in stream:
            first = first or time.perf_counter() - sent
        ttfts.append(first or 0.0)
    await client.close()
    shape = StepShape(prefill_tokens=PROBE_TOKENS, prefill_attention=PROBE_TOKENS * (PROBE_TOKENS + 1) // 2)
    step = cost.seconds(shape)
    return max(statistics.median(ttfts) - step, 0.0)


async def replay(trace: Trace, router_url: str) -> list[dict]:
    """Every conversation as a task: its turns in order, each streamed; TTFT is the first chunk's arrival."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    records: list[dict] = []
    started = time.perf_counter()

    async def conversation_task(index: int) -> None:
        conversation = trace.conversations[index]
        await asyncio.sleep(max(conversation.start_s - (time.perf_counter() - started), 0))
        for turn_index, turn in enumerate(conversation.turns):
            prompt = trace.prompt(conversation, turn_index)
            record = {"conversation": index, "turn": turn_index, "prompt_tokens": len(prompt), "ttft_s": None}
            records.append(record)
            sent = time.perf_counter()
            try:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=turn.answer_len,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                chunks = 0
                async for _chunk in stream:
                    if record["ttft_s"] is None:
                        record["ttft_s"] = time.perf_counter() - sent
                    chunks += 1
                record["e2e_s"] = time.perf_counter() - sent
            except openai.APIStatusError as error:  # a 429: every replica saturated; it ends, as simulated
                record["refused"] = error.status_code
                return
            await asyncio.sleep(turn.think_s)

    await asyncio.gather(*(conversation_task(i) for i in range(len(trace.conversations))))
    await client.close()
    return records


def run_real(trace: Trace, args: argparse.Namespace, router_config: RouterConfig, cost: StepCost,
             work_dir: Path) -> dict:
    env = {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    processes, replicas = [], []
    try:
        for index in range(args.replicas):
            command = [sys.executable, "-m", "pagoda", "serve", "--model", args.model, "--host", HOST, "--port",
                       str(free_port()), "--threads", str(args.threads), "--num-kv-blocks", str(args.num_kv_blocks),
                       "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
                       "--max-num-seqs", str(args.max_num_seqs), "--max-step-ms", str(args.max_step_ms)]
            process, url = start_server(command, work_dir / f"replica-{index}.log", timeout=300, env=env)
            processes.append(process)
            replicas.append(url)
        command = [sys.executable, "-m", "pagoda", "route", "--policy", router_config.policy, "--host", HOST,
                   "--port", str(free_port()), "--poll-interval", str(router_config.poll_interval_s)]
        for url in replicas:
            command += ["--replica", url]
        router, router_url = start_server(command, work_dir / "router.log", timeout=120)
        processes.append(router)
        overhead_s = asyncio.run(serving_overhead(router_url, cost, args.vocab_size))
        time.sleep(1.0)  # the replicas publish their counters after each step and every 0.5 s when idle
        before = [scrape(url) for url in replicas]
        started = time.perf_counter()
        records = asyncio.run(replay(trace, router_url))
        wall_s = time.perf_counter() - started
        time.sleep(1.0)
        counters = [{name: value - earlier[name] for name, value in scrape(url).items()}
                    for url, earlier in zip(replicas, before)]
    finally:
        for process in processes:
            stop_server(process)
    queries = sum(c["vllm:prefix_cache_queries_total"] for c in counters)
    hits = sum(c["vllm:prefix_cache_hits_total"] for c in counters)
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    return {"requests": len(records), "refused": sum(1 for r in records if "refused" in r), "wall_s": wall_s,
            "serving_overhead_s": overhead_s,
            "hit_rate": hits / queries if queries else 0.0, "prompt_tokens": queries, "hit_tokens": hits,
            **{f"ttft_s_p{q}": percentile(ttft, q) for q in (50, 90, 99)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPOSITORY / "src/pagoda/assets/pagoda-demo"))
    parser.add_argument("--step-cost", type=Path, default=DEFAULT_STEP_COST)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica (as calibrated)")
    parser.add_argument("--num-conversations", type=int, default=40)
    parser.add_argument("--conversation-rate", type=float, default=1.0)
    parser.add_argument("--think-time", type=float, default=2.0)
    parser.add_argument("--vocab-size", type=int, default=1024, help="at most the model's")
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-step-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.num_conversations, args.conversation_rate = 2, 6, 2.0
    trace_config = TraceConfig(num_conversations=args.num_conversations, conversation_rate=args.conversation_rate,
                               min_turns=2, max_turns=4, num_system_prompts=4, system_prompt_tokens=96,
                               user_tokens=(16, 48), answer_tokens=(8, 32), mean_think_s=args.think_time,
                               vocab_size=args.vocab_size, seed=args.seed)
    trace = generate_trace(trace_config)
    replica_config = ReplicaConfig(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        max_step_ms=args.max_step_ms),
        num_blocks=args.num_kv_blocks, block_size=args.block_size)
    router_config = RouterConfig(policy=args.policy, default_block_size=args.block_size, poll_interval_s=0.5)
    cost = StepCost.load(args.step_cost)
    work_dir = Path(tempfile.mkdtemp(prefix="pagoda-sim-validate-"))
    real = run_real(trace, args, router_config, cost, work_dir)
    # The serving overhead measured on the idle fleet joins the calibration (the trace's own latencies never do).
    cost = dataclasses.replace(cost, request_overhead_s=real["serving_overhead_s"])
    simulated = summarize(simulate(trace, args.replicas, replica_config, router_config, cost))
    hit_gap = abs(simulated["hit_rate"] - real["hit_rate"])
    ttft_ratio = (simulated["ttft_s_p50"] or 0.0) / real["ttft_s_p50"] if real["ttft_s_p50"] else float("nan")
    print(f"{'':<10}{'hit rate':>9}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'refused':>9}")
    for name, row in (("real", real), ("simulated", simulated)):
        print(f"{name:<10}{row['hit_rate']:>9.3f}{row['ttft_s_p50'] * 1e3:>13.1f}{row['ttft_s_p90'] * 1e3:>13.1f}"
              f"{row['refused']:>9}")
    print(f"hit-rate gap {hit_gap:.3f} (target <= 0.05); simulated / real TTFT p50 {ttft_ratio:.2f} "
          f"(target 0.8 to 1.2); serving overhead {real['serving_overhead_s'] * 1e3:.1f} ms")
    document = {"benchmark": "sim_validate", "command": " ".join(sys.argv), "config": vars(args) | {
        "out": str(args.out), "step_cost": str(args.step_cost), "model": args.model},
        "trace": dataclasses.asdict(trace_config), "step_cost": dataclasses.asdict(cost), "real": real,
        "simulated": simulated, "hit_rate_gap": hit_gap, "ttft_p50_ratio": ttft_ratio,
        "within_targets": hit_gap <= 0.05 and 0.8 <= ttft_ratio <= 1.2}
    write_result(args.out, document, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
