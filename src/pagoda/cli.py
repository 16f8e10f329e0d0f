"""`pagoda serve | generate | chat | calc | bench | route | lab | sim`: the command line, with vLLM's flag names."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.api_keys import add_api_key_arguments
from pagoda.engine_args import add_engine_args, engine_config_from, is_builtin_model, model_to_load, served_model_name
from pagoda.flag_values import format_bytes, json_object, parse_bytes, show_default
from pagoda.kernels import cap_torch_isa
from pagoda.text.reasoning import REASONING_PARSERS
from pagoda.tool_parser_names import TOOL_CALL_PARSER_NAMES

if TYPE_CHECKING:
    from pagoda.lora_request import LoRARequest
    from pagoda.tenant_door import Tenants
    from pagoda.wire.kv_events import KVEventsConfig

# What `pagoda bench` imports beyond serving's dependencies: the `bench` extra.
BENCH_EXTRA_MODULES = ("httpx", "matplotlib")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run_serve(args: argparse.Namespace) -> int:
    from pagoda.api_keys import ApiKeys
    from pagoda.engine.external_ranks import run_if_worker_rank
    from pagoda.server.launcher import exit_now, serve
    from pagoda.tenant_door import Tenants
    from pagoda.wire.limits import ServerLimits

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagoda serve: --enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(TOOL_CALL_PARSER_NAMES)})")
    try:
        api_keys = ApiKeys.from_args(args)
        tenants = Tenants(api_keys, args.tenant_config, enforce_limits=args.tenant_rate_limits)
        given = {name: getattr(args, name) for name in SERVER_LIMITS if getattr(args, name) is not None}
        limits = ServerLimits(**given)
        kv_events = kv_events_config(args.kv_events_config)
        lora_modules = lora_modules_of(args)
        if args.allow_runtime_lora_updating and not args.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    except (OSError, ValueError) as error:
        raise SystemExit(f"pagoda serve: {error}") from None
    args.model = model_to_load(args.model, "serve")
    tool_call_parser = auto_tool_call_parser(args)
    if args.data_parallel_size > 1:
        exit_now(run_data_parallel(args, tenants if tenants.configured else None))
    engine_config = engine_config_from(args)
    try:
        run_if_worker_rank(engine_config)  # before the port is taken: only rank 0 serves HTTP
    except ValueError as error:
        raise SystemExit(f"pagoda serve: {error}") from None
    code = serve(
        engine_config,
        model_name=served_model_name(args.model, args.served_model_name),
        host=args.host, port=args.port, api_keys=api_keys, limits=limits,
        max_waiting_requests=args.max_waiting_requests, drain_timeout=args.shutdown_timeout,
        log_level=args.uvicorn_log_level,
        tool_call_parser=tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        web_ui=not args.disable_web_ui,
        builtin_model=is_builtin_model(args.model),
        kv_events=kv_events,
        profile_dir=args.profile_dir,
        lora_modules=lora_modules,
        runtime_lora_updating=args.allow_runtime_lora_updating,
        tenants=tenants,
    )
    exit_now(code)


def lora_modules_of(args: argparse.Namespace) -> list[LoRARequest]:
    """--lora-modules, each entry the adapter a request's `model` may name; they need --enable-lora."""
    from pagoda.lora_request import parse_lora_module

    entries: list[str] = args.lora_modules or []
    if entries and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    modules = [parse_lora_module(entry, index) for index, entry in enumerate(entries, 1)]
    names = [module.lora_name for module in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: each name may be given once, got {', '.join(names)}")
    return modules


def auto_tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None when it is off. The built-in model has it on unless
    --no-enable-auto-tool-choice: it was trained to call tools in one known form."""
    if args.enable_auto_tool_choice:
        parser: str | None = args.tool_call_parser
        return parser
    if args.enable_auto_tool_choice is None and is_builtin_model(args.model):
        from pagoda.demo import DEMO_TOOL_CALL_PARSER

        print(f"pagoda serve: tool calling on ({DEMO_TOOL_CALL_PARSER} parser, the built-in model's form; "
              "--no-enable-auto-tool-choice turns it off)", file=sys.stderr)
        return DEMO_TOOL_CALL_PARSER
    return None


def run_data_parallel(args: argparse.Namespace, tenants: Tenants | None = None) -> int:
    """--data-parallel-size N: N engine processes behind the router (pagoda.router.data_parallel)."""
    from pagoda.router.data_parallel import plan_engines, serve_data_parallel

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    try:
        plan = plan_engines(commands.choices["serve"], args)
    except ValueError as error:
        raise SystemExit(f"pagoda serve: {error}") from None
    return serve_data_parallel(plan, args, tenants)


def kv_events_config(values: dict[str, Any] | None) -> KVEventsConfig | None:
    """--kv-events-config (vLLM's KVEventsConfig as JSON), or None when not given."""
    if values is None:
        return None
    from pagoda.wire.kv_events import KVEventsConfig

    return KVEventsConfig.from_dict(values)


# The `serve` flags that bound one request (pagoda.wire.limits.ServerLimits' fields, defaults there).


class ServeHelpFormatter(argparse.HelpFormatter):
    """Fills `{default}` in the request-bound flags' help from ServerLimits when help is shown: reading it
    while building the parser would import the wire package (pydantic) into every command."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is not None and "{default}" in text:
            from pagoda.wire.limits import ServerLimits

            value = getattr(ServerLimits, action.dest)
            shown = format_bytes(value) if action.type is parse_bytes else show_default(value)
            text = text.replace("{default}", shown)
        return text


SERVER_LIMITS = ("max_request_body_bytes", "max_chars_per_token", "max_sequences_per_request", "max_stop_strings",
                 "max_stop_string_chars", "max_logit_bias", "request_timeout", "request_read_timeout")


def run_generate(args: argparse.Namespace) -> int:
    from pagoda.engine.api import RequestOutput
    from pagoda.engine.engine import LLMEngine
    from pagoda.model_dir import ModelLoadError
    from pagoda.sampling import SamplingParams
    from pagoda.text.tokenizer import ChatTemplateError, encode_chat

    args.model = model_to_load(args.model, "generate")
    try:
        engine = LLMEngine(engine_config_from(args))
    except ModelLoadError as error:  # a broken checkpoint, or a draft model that cannot draft for it
        print(f"pagoda generate: {error}", file=sys.stderr)
        return 2
    prompt: str | list[int] = args.prompt
    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    if args.chat or (has_template and not args.raw):
        try:
            prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
        except ChatTemplateError as error:
            print(f"pagoda generate: {error}", file=sys.stderr)
            return 2
        print("pagoda generate: the prompt goes through the model's chat template (--raw: plain completion)",
              file=sys.stderr)
    else:
        why = "--raw" if args.raw else "the model has no chat template"
        print(f"pagoda generate: plain completion ({why})", file=sys.stderr)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.gen_seed,
                            max_tokens=args.max_tokens)
    if args.trace_file is not None:
        engine.trace.start()
    engine.add_request("cli", prompt, params)
    printed = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not isinstance(output, RequestOutput):
                    continue  # an embedding's: never asked for here
                text = output.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    if args.trace_file is not None:
        args.trace_file.write_text(json.dumps(engine.trace.stop()), encoding="utf-8")
        print(f"pagoda generate: wrote the steps' timeline to {args.trace_file}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=ServeHelpFormatter)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                       help="LoRA adapters a request's model may name, with --enable-lora: name=path, or vLLM's JSON "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\' (docs/lora.md)')
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the "
                            "served adapters (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; docs/lora.md)")
    add_api_key_arguments(serve)
    serve.add_argument("--tenant-config", default=None, metavar="PATH",
                       help="a JSON file of tenants: their API keys (or a gateway's header), requests and tokens per "
                            "minute, adapters and prefix-cache sharing; reloaded on SIGHUP (docs/tenants.md)")
    serve.add_argument("--tenant-rate-limits", action=argparse.BooleanOptionalAction, default=True,
                       help="with --tenant-config: count the tenants' requests and tokens per minute here; "
                            "--no-tenant-rate-limits for a replica behind a front that counts them for the whole "
                            "fleet (pagoda route --tenant-config; --data-parallel-size sets it on its engines)")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 429 to a request whose sequences (prompts x n) would take the waiting queue "
                            "past this many (default: unbounded)")
    serve.add_argument("--max-request-body-bytes", type=parse_bytes, default=None,
                       help="answer 413 to a larger request body (suffixes K, M, G; default {default})")
    serve.add_argument("--max-chars-per-token", type=float, default=None,
                       help="refuse a prompt longer than max_model_len x this many characters before tokenizing "
                            "it (default {default})")
    serve.add_argument("--max-sequences-per-request", type=int, default=None,
                       help="most sequences (prompts x n) one request may ask for (default {default})")
    serve.add_argument("--max-stop-strings", type=int, default=None, help="most stop strings (default {default})")
    serve.add_argument("--max-stop-string-chars", type=int, default=None,
                       help="longest stop string, in characters (default {default})")
    serve.add_argument("--max-logit-bias", type=int, default=None, help="most logit_bias entries (default {default})")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds from a request's arrival to its last token; then it is aborted and "
                            "answered 504 (default {default}; 0: no limit)")
    serve.add_argument("--request-read-timeout", type=float, default=None,
                       help="seconds a client has to send a request's headers and body, from its first byte "
                            "(or the connection's opening); then the connection is closed (default {default})")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    serve.add_argument("--uvicorn-log-level", default="warning")
    serve.add_argument("--disable-web-ui", action="store_true",
                       help="no chat page at / and no dashboard at /dashboard (docs/web-ui.md)")
    serve.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                       help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser '
                            "(default: on for the built-in model, in the form it was trained on; off otherwise)")
    serve.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSER_NAMES), default=None,
                       help="the model's tool-call format, as its chat template teaches it")
    serve.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="split a thinking model's output: the thinking goes to message.reasoning (and "
                            "reasoning_content), the answer to content; tool calls are read from the answer "
                            "(default: no split)")
    serve.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                       help="engine processes on this machine, behind pagoda's router on --port; --threads is "
                            "split evenly between them (docs/router.md)")
    serve.add_argument("--kv-events-config", type=json_object, default=None,
                       help='publish KV cache events as vLLM does (docs/router.md), vLLM\'s JSON: '
                            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'')
    serve.add_argument("--profile-dir", type=Path, default=None,
                       help="enable POST /start_profile and /stop_profile (vLLM's routes): the engine's steps "
                            "between them, written here as a Chrome trace (docs/step-timeline.md)")
    serve.set_defaults(func=run_serve)

    generate = commands.add_parser("generate", help="stream one completion to the terminal")
    add_engine_args(generate)
    generate.add_argument("prompt")
    template = generate.add_mutually_exclusive_group()
    template.add_argument("--chat", action="store_true",
                          help="the model's chat template, or an error if it has none (default: the template "
                               "when the model has one)")
    template.add_argument("--raw", action="store_true", help="plain completion: the prompt as given, no template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--gen-seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--trace-file", type=Path, default=None,
                          help="write the generation's engine steps here as a Chrome trace (docs/step-timeline.md)")
    generate.set_defaults(func=run_generate)

    from pagoda.calc.cli import add_parser as add_calc
    from pagoda.chat import add_parser as add_chat
    from pagoda.labs.cli import add_parser as add_lab
    from pagoda.router.cli import add_parser as add_route
    from pagoda.sim.cli import add_parser as add_sim

    add_chat(commands)
    add_calc(commands)
    add_bench_command(commands)
    add_route(commands)
    add_lab(commands)
    add_sim(commands)
    return parser


def add_bench_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`pagoda bench`, or where the bench extra is not installed, a `bench` that says how to install it."""
    try:
        from pagoda.bench.cli import add_parser
    except ModuleNotFoundError as error:
        if error.name not in BENCH_EXTRA_MODULES:
            raise
        missing = error.name
        # No prefix characters: every argument is taken as-is, so any bench command line reaches the message.
        bench = commands.add_parser("bench", help="load-test a server (pip install 'pagoda[bench]')",
                                    add_help=False, prefix_chars="\0")
        bench.add_argument("arguments", nargs="*")
        bench.set_defaults(func=lambda _args: _bench_extra_missing(missing))
        return
    add_parser(commands)


def _bench_extra_missing(module: str) -> int:
    print(f"pagoda bench needs {module}: pip install 'pagoda[bench]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    cap_torch_isa()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
