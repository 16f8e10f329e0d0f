"""KV offloading: the time to first token of a returning conversation turn whose 2,000-token prefix the KV pool
has evicted, served by the local tier, by the shared tier (Redis), or recomputed, in one run.

Workload (defaults): 3 conversations, each a 2,000-token history, on a KV pool that holds one conversation. Turn 1
of each computes its history; by the time a conversation returns, the others have evicted it from the pool. Each
returning turn is the history plus 32 new tokens, 16 output tokens, greedy. Engines on the same weights run
the same conversations, in-process, one request at a time:

- recompute: no offloading: the returning turn computes its 2,032 tokens;
- local: `--kv-offloading-size`: the returning turn loads its history from the local tier;
- shared: replica A (shared tier only) runs every turn 1; replica B, sharing only the Redis store with A, runs
  the returning turns: its history comes from what A computed.

Reported per mode: the returning turns' TTFT (request added -> first token), the tokens and bytes loaded, and the
output of every returning turn, which must equal recompute's token for token. The modes' returning turns run back
to back, conversation by conversation. Figures of merit: recompute TTFT / tier TTFT, the median over the
conversations (target >= 5 for both tiers), and bytes moved per loaded token
against `pagoda calc`'s KV bytes per token (the difference is the blocks' headers). Writes JSON, with the host's
CPU (lscpu's model name).

    python benchmarks/kv_offload.py --model /path/to/bench-125m [--history 2000] [--conversations 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import write_result

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY / "src"))

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.calc.formulas import kv_bytes_per_token  # noqa: E402
from pagoda.engine.api import KVTierStats  # noqa: E402

TARGET_SPEEDUP = 5.0
MODES = ("recompute", "local", "shared")


def lscpu_model_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("kv_offload.py: the shared tier needs redis-server (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("kv_offload.py: redis-server did not start")


def conversations(count: int, history: int, follow_up: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab_size) for _ in range(history + follow_up)] for _ in range(count)]


def timed_turn(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """(seconds from the request's arrival to its first token, its output tokens)."""
    engine = llm.engine
    request_id = f"turn-{time.monotonic_ns()}"
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first_token, tokens = None, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first_token is None and output.outputs[0].token_ids:
                first_token = time.perf_counter() - started
            tokens = list(output.outputs[0].token_ids)
    if engine.kv_connector is not None:
        engine.kv_connector.worker.wait_for_saves(60.0)
    assert first_token is not None
    return first_token, tokens


def tier_dict(stats: KVTierStats) -> dict:
    return {"medium": stats.medium, "hit_blocks": stats.hit_blocks, "hit_tokens": stats.hit_tokens,
            "bytes_loaded": stats.bytes_loaded, "bytes_saved": stats.bytes_saved, "load_seconds": stats.load_seconds,
            "failures": stats.failures, "refused_blocks": stats.refused_blocks}


def mode_result(llm: LLM, ttfts: list[float], outputs: list[list[int]]) -> dict:
    stats = llm.engine.stats()
    result = {"ttft_s": ttfts, "ttft_p50_s": statistics.median(ttfts), "outputs": outputs,
              "prefix_cache_hits": stats.prefix_cache_hits, "prompt_tokens_computed": stats.prompt_tokens_computed}
    if stats.kv_connector is not None:
        result["external_prefix_cache_hits"] = stats.kv_connector.external_prefix_cache_hits
        result["tiers"] = [tier_dict(tier) for tier in stats.kv_connector.tiers]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--follow-up", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--offloading-gib", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPOSITORY / "benchmarks" / "results" / "kv_offload.json"))
    args = parser.parse_args()

    max_model_len = args.history + args.follow_up + args.output_tokens
    blocks_per_conversation = -(-max_model_len // args.block_size)
    engine_options = {"dtype": args.dtype, "block_size": args.block_size, "max_model_len": max_model_len,
                      "num_kv_blocks": blocks_per_conversation + 8, "max_num_batched_tokens": 2048,
                      "max_num_seqs": 1}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    workdir = Path(tempfile.mkdtemp(prefix="pagoda-kv-offload-"))
    redis_process, redis_url = start_redis(workdir)
    shared = {"kv_transfer_config": {"kv_connector": "OffloadingConnector",
                                     "kv_connector_extra_config": {"shared_store": redis_url,
                                                                   "store_timeout_ms": 2000}}}
    try:
        # Each mode's engine: recompute, local, and the shared tier's writer and reader replicas.
        engines = {"recompute": LLM(args.model, **engine_options),
                   "local": LLM(args.model, kv_offloading_size=args.offloading_gib, **engine_options),
                   "shared_writer": LLM(args.model, **engine_options, **shared),
                   "shared": LLM(args.model, **engine_options, **shared)}
        model_config = engines["recompute"].engine.model_config
        convs = conversations(args.conversations, args.history, args.follow_up, model_config.vocab_size, args.seed)
        for conv in convs:  # turn 1: each history computed; each evicts the one before from the pool
            for name in ("recompute", "local", "shared_writer"):
                timed_turn(engines[name], conv[: args.history], params)
        # The returning turns, the modes back to back for each conversation, so that a machine whose load drifts
        # weighs on every mode alike.
        ttfts: dict[str, list[float]] = {mode: [] for mode in MODES}
        outputs: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
        for conv in convs:
            for mode in MODES:
                ttft, tokens = timed_turn(engines[mode], conv, params)
                ttfts[mode].append(ttft)
                outputs[mode].append(tokens)
            print("returning turn TTFT: " + ", ".join(f"{mode} {ttfts[mode][-1] * 1e3:.0f} ms" for mode in MODES),
                  flush=True)
        results = {mode: mode_result(engines[mode], ttfts[mode], outputs[mode]) for mode in MODES}
        for llm in engines.values():
            llm.close()
    finally:
        redis_process.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    calc_bytes = kv_bytes_per_token(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                    args.dtype)
    ratios, bytes_per_token = {}, {}
    for mode in ("local", "shared"):
        per_conversation = [r / t for r, t in zip(results["recompute"]["ttft_s"], results[mode]["ttft_s"])]
        ratios[f"recompute_over_{mode}_ttft"] = statistics.median(per_conversation)
        (tier,) = results[mode]["tiers"]
        bytes_per_token[mode] = tier["bytes_loaded"] / tier["hit_tokens"] if tier["hit_tokens"] else None
        results[mode]["load_seconds_per_turn"] = tier["load_seconds"] / args.conversations
        assert results[mode]["outputs"] == results["recompute"]["outputs"], f"{mode}: outputs differ from recompute"
        assert results[mode]["external_prefix_cache_hits"] == tier["hit_tokens"]
    result = {
        "workload": {"model": Path(args.model).name, "history_tokens": args.history, "follow_up_tokens": args.follow_up,
                     "output_tokens": args.output_tokens, "conversations": args.conversations,
                     "block_size": args.block_size, "dtype": args.dtype, "pool_blocks": engine_options["num_kv_blocks"],
                     "threads": os.environ.get("OMP_NUM_THREADS")},
        "host": {"lscpu_model_name": lscpu_model_name(), "cpus": os.cpu_count()},
        "modes": results,
        "ratios": ratios,
        "kv_bytes_per_token": {"calc": calc_bytes, "moved_per_loaded_token": bytes_per_token,
                               "overhead_fraction": {mode: (value / calc_bytes - 1) if value else None
                                                     for mode, value in bytes_per_token.items()}},
        "targets": {"speedup_min": TARGET_SPEEDUP},
        "targets_met": all(ratio >= TARGET_SPEEDUP for ratio in ratios.values()),
        "outputs_equal": True,
    }
    write_result(args.out, result)
    print(f"recompute / local TTFT: {ratios['recompute_over_local_ttft']:.1f}x, recompute / shared TTFT: "
          f"{ratios['recompute_over_shared_ttft']:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)")
    print(f"bytes moved per loaded token: {bytes_per_token}  (pagoda calc: {calc_bytes:.0f})")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
