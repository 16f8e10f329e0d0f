"""Peers: pagoda against Hugging Face `transformers` on the same weights and dtype, in one run.

Workloads (greedy, ignore_eos; random token-id prompts, the same for every engine):
  decode   batch 1, 128-token prompt, 128 new tokens: median decode-step rate (tok/s); pagoda
           LLMEngine.step() timed per step, transformers.generate timed per step by a logits processor
  prefill  one 1,024-token prompt: time to the first token (pagoda step vs generate(max_new_tokens=1))
  offline  32 prompts 128 -> 64: pagoda LLM.generate vs transformers.generate, static batch of 32
  served   the same 32 x (128 -> 64) through `pagoda serve` (subprocess on loopback, same engine options
           as offline), 32 concurrent streams from the openai AsyncOpenAI client, token ids as prompts to
           /v1/completions, ignore_eos
  hf-serve the same 32 streams through `transformers serve --continuous-batching` (text prompts that
           tokenize to exactly 128 tokens; EOS disabled through its generation_config field)

pagoda int8 (weight-only, bf16 activations) is compared with transformers bf16: transformers has no
CPU int8 weight-only path without extra packages. Targets: decode pagoda/HF fp32 >= 1.7x, bf16 or int8
>= 2.5x; offline fp32 >= 1.1x, bf16 >= 1.5x; served/offline >= 0.85; served/transformers-serve >= 3x.

    python benchmarks/peers.py [--threads 2] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    CONFIGS,
    TORCH_DTYPES,
    add_common_args,
    environment,
    load_average,
    log,
    make_llm,
    make_prompts,
    run_engine,
    save_bar_png,
    set_threads,
    summary,
    write_json,
)
from server_process import HOST, free_port, start_server, stop_server

HF_SERVE = """import sys
import transformers.modeling_utils as modeling_utils
if {shim}:  # the CLI passes device_map, which needs `accelerate`; on CPU, no device_map means the same placement
    original = modeling_utils.check_and_set_device_map
    modeling_utils.check_and_set_device_map = lambda m: None if m in ("cpu", None) else original(m)
from transformers.cli.transformers import main
sys.argv = ["transformers", *sys.argv[1:]]
sys.exit(main())
"""
TARGETS = {("decode", "fp32"): 1.7, ("decode", "bf16"): 2.5, ("decode", "int8"): 2.5, ("offline", "fp32"): 1.1,
           ("offline", "bf16"): 1.5, ("served/offline", None): 0.85, ("served/hf-serve", None): 3.0}


class StepClock:
    """A logits processor that records when each generation step reaches sampling."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Seconds for the whole generate, and the per-step times after the first token."""
    from transformers import LogitsProcessorList

    clock, input_ids = StepClock(), torch.tensor(prompts)
    started = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList([clock]))
    elapsed = time.perf_counter() - started
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return elapsed, [b - a for a, b in zip(clock.times, clock.times[1:])]


def pagoda_generate(llm, prompts: list[list[int]], new_tokens: int) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    return elapsed


def load_hf(model_dir: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()


def pairs(configs: list[str]) -> list[tuple[str, list[str]]]:
    """Groups pagoda configs by the transformers dtype they are compared with."""
    grouped: dict[str, list[str]] = {}
    for config in configs:
        grouped.setdefault(CONFIGS[config][0], []).append(config)
    return list(grouped.items())


def local_workloads(model: str, args) -> list[dict]:
    """decode / prefill / offline for every config, each repeat interleaved with its transformers peer."""
    rows, path = [], f"{args.models_dir}/{model}"
    vocab = load_hf_vocab(path)
    for hf_dtype, configs in pairs(args.configs.split(",")):
        hf = load_hf(path, hf_dtype)
        hf_generate(hf, make_prompts(2, 16, vocab, seed=99), 4)  # warm-up
        for config in configs:
            for kind in args.workloads.split(","):
                if kind in ("decode", "prefill", "offline") and (kind != "offline" or model in args.offline_models):
                    rows.append(compare_local(kind, hf, path, model, config, vocab, args))
                    log(f"  {kind} {model} {config}: pagoda {rows[-1]['pagoda']:.2f} vs transformers "
                        f"{rows[-1]['transformers']:.2f} {rows[-1]['unit']} -> {rows[-1]['ratio']:.2f}x")
        del hf
        gc.collect()
    return rows


def load_hf_vocab(path: str) -> int:
    return json.loads(Path(path, "config.json").read_text())["vocab_size"]


def compare_local(kind: str, hf, path: str, model: str, config: str, vocab: int, args) -> dict:
    prompt_len, new_tokens = {"decode": (args.prompt_len, args.decode_tokens), "prefill": (args.prefill_tokens, 1),
                              "offline": (args.prompt_len, args.offline_tokens)}[kind]
    batch = args.num_prompts if kind == "offline" else 1
    llm = make_llm(path, config, batch, prompt_len + new_tokens)
    run_engine(llm.engine, make_prompts(min(batch, 4), 16, vocab, seed=99), 4)  # warm-up
    pagoda, peer = [], []
    for repeat in range(args.repeats):
        prompts = make_prompts(batch, prompt_len, vocab, seed=1000 * repeat + len(kind))
        if kind == "decode":
            steps = [r.seconds for r in run_engine(llm.engine, prompts, new_tokens)[1:]]
            pagoda.append(1 / statistics.median(steps))
            peer.append(1 / statistics.median(hf_generate(hf, prompts, new_tokens)[1]))
        elif kind == "prefill":
            pagoda.append(run_engine(llm.engine, prompts, 1)[0].seconds)
            peer.append(hf_generate(hf, prompts, 1)[0])
        else:
            pagoda.append(batch * new_tokens / pagoda_generate(llm, prompts, new_tokens))
            peer.append(batch * new_tokens / hf_generate(hf, prompts, new_tokens)[0])
    del llm
    gc.collect()
    p, h = statistics.median(pagoda), statistics.median(peer)
    higher_is_better = kind != "prefill"
    return {"workload": kind, "model": model, "config": config, "transformers_dtype": CONFIGS[config][0],
            "unit": "tok/s" if higher_is_better else "s", "pagoda": p, "transformers": h,
            "ratio": p / h if higher_is_better else h / p, "pagoda_samples": summary(pagoda),
            "transformers_samples": summary(peer), "target": TARGETS.get((kind, config)),
            "comparison": f"pagoda {config} / transformers.generate {CONFIGS[config][0]}"}


# --- servers -------------------------------------------------------------------------------------


async def drive(base: str, model: str, prompts: list, max_tokens: int, extra: dict, timeout: float) -> dict:
    """All prompts at once, streamed; wall time from the first send to the last token."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=timeout)

    async def one(prompt) -> tuple[int, int]:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra)
        chunks, usage = 0, None
        async for chunk in stream:
            chunks += any(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return (usage.completion_tokens, usage.prompt_tokens) if usage else (chunks, -1)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - started
    await client.close()
    output_tokens = sum(r[0] for r in results)
    return {"wall_s": wall, "output_tokens": output_tokens, "tokens_per_s": output_tokens / wall,
            "completion_tokens": [r[0] for r in results], "prompt_tokens": [r[1] for r in results]}


def exact_text_prompts(model_dir: str, count: int, length: int, seed: int) -> list[str]:
    """Texts that the model's tokenizer turns into exactly `length` tokens (BOS included)."""
    from transformers import AutoTokenizer

    tokenizer, rng, texts = AutoTokenizer.from_pretrained(model_dir), random.Random(seed), []
    while len(texts) < count:
        ids = [rng.randrange(10, tokenizer.vocab_size) for _ in range(length)]
        for _ in range(8):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            encoded = tokenizer(text)["input_ids"]
            if len(encoded) == length:
                texts.append(text)
                break
            ids = (encoded[1:] + [rng.randrange(10, tokenizer.vocab_size) for _ in range(8)])[: length - 1]
    return texts


def served(kind: str, model: str, config: str, args, log_dir: Path) -> dict:
    path, port = f"{args.models_dir}/{model}", free_port()
    dtype, quantization = CONFIGS[config]
    if kind == "pagoda":
        blocks = args.num_prompts * ((args.prompt_len + args.offline_tokens) // 16 + 2) + 16  # as make_llm
        command = [sys.executable, "-m", "pagoda", "serve", "--model", path, "--port", str(port), "--host", HOST,
                   "--dtype", dtype, "--max-num-seqs", str(args.num_prompts), "--max-num-batched-tokens", "4096",
                   "--max-model-len", str(args.prompt_len + args.offline_tokens + 16),
                   "--num-kv-blocks", str(blocks), "--uvicorn-log-level", "warning",
                   "--threads", str(args.threads)]
        command += ["--quantization", quantization] if quantization else []
        extra = {"ignore_eos": True}
        shown = ["pagoda", *command[3:]]
    else:
        shim = importlib.util.find_spec("accelerate") is None
        command = [sys.executable, "-c", HF_SERVE.format(shim=shim), "serve", "--continuous-batching", "--device",
                   "cpu", "--dtype", dtype, "--host", HOST, "--port", str(port), path]
        extra = {"generation_config": f'{{"max_new_tokens": {args.offline_tokens}, "do_sample": false, '
                                      '"eos_token_id": []}'}
        shown = ["transformers", *command[3:]]
    log(f"  starting {kind} server: {' '.join(shown)}")
    process, base = start_server(command, log_dir / f"{kind}-{config}.log", args.startup_timeout,
                                 env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    samples = []
    try:
        vocab = load_hf_vocab(path)
        warm = make_prompts(2, 16, vocab, seed=99) if kind == "pagoda" else ["warm up the server", "and again"]
        # One request alone first: transformers builds its continuous-batching manager on the first request,
        # and requests racing that set-up can be dropped.
        asyncio.run(drive(base, path, warm[:1], 4, extra, args.request_timeout))
        asyncio.run(drive(base, path, warm, 4, extra, args.request_timeout))
        for repeat in range(args.repeats):
            if kind == "pagoda":
                prompts = make_prompts(args.num_prompts, args.prompt_len, vocab, seed=2000 * repeat + 7)
            else:
                prompts = exact_text_prompts(path, args.num_prompts, args.prompt_len, seed=2000 * repeat + 7)
            samples.append(asyncio.run(drive(base, path, prompts, args.offline_tokens, extra, args.request_timeout)))
            log(f"  {kind} serve {config} repeat {repeat + 1}/{args.repeats}: "
                f"{samples[-1]['tokens_per_s']:.1f} output tok/s ({samples[-1]['wall_s']:.1f} s)")
    finally:
        stop_server(process, signal.SIGINT)
    rates = [s["tokens_per_s"] for s in samples]
    note = ""
    if kind != "pagoda" and shim:
        note = ("the `transformers serve` CLI needs `accelerate` for its device_map (not installed): it ran through "
                "transformers' own CLI entry point with device_map dropped (the model is on CPU either way)")
    return {"server": kind, "model": model, "config": config, "dtype": dtype, "tokens_per_s": statistics.median(rates),
            "samples": samples, "rates": summary(rates), "command": " ".join(shown), "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "benchmarks/results/peers.json")
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--models", default="bench-125m", help="models for decode / prefill (bench-1b is slow)")
    parser.add_argument("--offline-models", default="bench-125m")
    parser.add_argument("--configs", default="fp32,bf16,int8")
    parser.add_argument("--serve-configs", default="fp32,bf16", help="pagoda serve configs (bench-125m)")
    parser.add_argument("--hf-serve-configs", default="fp32", help="transformers serve dtypes ('' to skip)")
    parser.add_argument("--workloads", default="decode,prefill,offline,served,hf-serve")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--offline-tokens", type=int, default=64)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=3600)
    args = parser.parse_args()
    if args.quick:
        args.decode_tokens, args.prefill_tokens, args.num_prompts, args.offline_tokens = 16, 256, 8, 8
    args.repeats = args.repeats or (1 if args.quick else 3)
    set_threads(args.threads)
    load_start = load_average()
    log(f"peers: torch threads {args.threads}, load average {load_start}")
    wanted = {"decode", "prefill", "offline"} & set(args.workloads.split(","))
    local = [row for model in filter(None, args.models.split(",")) if wanted for row in local_workloads(model, args)]
    servers, log_dir = [], Path(tempfile.mkdtemp(prefix="pagoda-peers-"))
    workloads = args.workloads.split(",")
    for kind, configs in (("pagoda", args.serve_configs), ("hf-serve", args.hf_serve_configs)):
        if (kind == "pagoda" and "served" in workloads) or (kind in workloads):
            for config in filter(None, configs.split(",")):
                try:
                    servers.append(served(kind, "bench-125m", config, args, log_dir))
                except RuntimeError as error:
                    log(f"  {kind} serve {config} could not run: {error}")
                    servers.append({"server": kind, "config": config, "error": str(error)})
    ratios = list(local)
    for row in (s for s in servers if s["server"] == "pagoda" and "error" not in s):
        offline = next((r for r in local if r["workload"] == "offline" and r["config"] == row["config"]), None)
        if offline:
            ratios.append({"workload": "served/offline", "model": row["model"], "config": row["config"],
                           "pagoda": row["tokens_per_s"], "transformers": offline["pagoda"], "unit": "tok/s",
                           "ratio": row["tokens_per_s"] / offline["pagoda"],
                           "target": TARGETS[("served/offline", None)],
                           "comparison": "pagoda serve / pagoda LLM.generate"})
        peer = next((s for s in servers if s["server"] == "hf-serve" and s.get("dtype") == row["dtype"]
                     and "error" not in s), None)
        if peer:
            ratios.append({"workload": "served/hf-serve", "model": row["model"], "config": row["config"],
                           "pagoda": row["tokens_per_s"], "transformers": peer["tokens_per_s"], "unit": "tok/s",
                           "ratio": row["tokens_per_s"] / peer["tokens_per_s"],
                           "target": TARGETS[("served/hf-serve", None)],
                           "comparison": f"pagoda serve / transformers serve --continuous-batching ({peer['dtype']})"})
    print(f"\n{'workload':<17}{'model':<12}{'config':<7}{'pagoda':>11}{'peer':>11}{'unit':>7}{'ratio':>8}{'target':>8}"
          "  ok  comparison")
    for r in ratios:
        ok = "" if r["target"] is None else ("yes" if r["ratio"] >= r["target"] else "NO")
        target = "" if r["target"] is None else f"{r['target']:.2f}"
        print(f"{r['workload']:<17}{r['model']:<12}{r['config']:<7}{r['pagoda']:>11.2f}{r['transformers']:>11.2f}"
              f"{r['unit']:>7}{r['ratio']:>7.2f}x{target:>8}  {ok:<3} {r['comparison']}")
    for s in servers:
        if "error" in s or s.get("note"):
            print(f"note: {s['server']} {s['config']}: {s.get('error') or s['note']}")
    write_json(args.out, {"config": vars(args), "environment": environment(load_start), "ratios": ratios,
                          "servers": servers, "server_logs": str(log_dir)})
    save_bar_png(args.out.removesuffix(".json") + ".png", f"pagoda / peer ({args.threads} threads, load "
                 f"{load_start[0]})", [f"{r['workload']} {r['model']} {r['config']}" for r in ratios],
                 [r["ratio"] for r in ratios], [r["target"] for r in ratios], "ratio (x)")


if __name__ == "__main__":
    main()
