"""`pagoda serve | generate | calc`: the command line, with vLLM's flag names where vLLM has one."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEMO_MODEL = Path(__file__).parent / "assets" / "pagoda-demo"
FALLBACK_MODEL = Path.home() / ".cache" / "pagoda" / "tiny-random-llama"


def default_model() -> str:
    """The built-in demo model; until one is shipped, a tiny random-weight model made on first use."""
    if (DEMO_MODEL / "config.json").is_file():
        return str(DEMO_MODEL)
    if not (FALLBACK_MODEL / "config.json").is_file():
        from pagoda.testing.checkpoints import make_checkpoint

        logging.getLogger("pagoda").warning("no demo model shipped: making a tiny random one in %s", FALLBACK_MODEL)
        make_checkpoint(FALLBACK_MODEL, "llama", hidden_size=128, num_layers=4, vocab_size=512)
    return str(FALLBACK_MODEL)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: built-in)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", "-q", default=None, choices=["int8"],
                        help="int8: weight-only W8A16, per-output-channel symmetric, quantized at load")
    parser.add_argument("--use-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="pagoda's native CPU kernels (compiled on first use) where they apply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=_bytes, default=2 << 30,
                        help="KV pool size in bytes (suffixes K, M, G: 2G = 2 GiB)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="explicit pool size in blocks")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice, one per physical core)")


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def engine_config_from(args: argparse.Namespace):
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from pagoda.entrypoints import build_engine_config

    return build_engine_config(
        args.model, dtype=args.dtype, device=args.device, seed=args.seed, quantization=args.quantization,
        use_kernels=args.use_kernels, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
    )


def run_serve(args: argparse.Namespace) -> int:
    from pagoda.server.launcher import serve

    args.model = args.model or default_model()
    return serve(
        engine_config_from(args),
        model_name=args.served_model_name or args.model,
        host=args.host, port=args.port, api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests, drain_timeout=args.shutdown_timeout,
        log_level=args.uvicorn_log_level,
    )


def run_generate(args: argparse.Namespace) -> int:
    from pagoda.engine.engine import LLMEngine
    from pagoda.sampling import SamplingParams

    args.model = args.model or default_model()
    engine = LLMEngine(engine_config_from(args))
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "user", "content": prompt}]
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = engine.tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.gen_seed,
                            max_tokens=args.max_tokens)
    engine.add_request("cli", prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 429 when this many requests are already waiting")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.set_defaults(func=run_serve)

    generate = commands.add_parser("generate", help="stream one completion to the terminal")
    add_engine_args(generate)
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--gen-seed", type=int, default=None, help="sampling seed")
    generate.set_defaults(func=run_generate)

    from pagoda.calc.cli import add_parser as add_calc

    add_calc(commands)
    from pagoda.bench.cli import add_parser as add_bench
    add_bench(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
