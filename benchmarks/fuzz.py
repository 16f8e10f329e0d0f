"""Fuzz `pagoda serve`, with one of two strategies:

- `openapi` (fuzz_openapi.py): schemathesis generates requests from `/openapi.json`, schema-valid and
  schema-breaking, for every operation; a finding is a 5xx, an error not in OpenAI's shape, a response the
  document does not describe, or /health slow between operations.
- `grammar` (fuzz_grammar.py): output constraints from grammar_poisons.py, well-formed and hostile (JSON
  schemas, regexes, choice lists, Lark grammars, tool definitions), sent through response_format,
  structured_outputs, vLLM's former guided_* fields and tools, in small concurrent batches beside a bystander
  stream that must come through untouched; a finding is a 5xx (status or error event), an error not in
  OpenAI's shape, a bystander lost or diverged, /health slow between batches, or requests or KV blocks left
  once the load stops.

The grammar strategy needs nothing but the standard library. schemathesis is not a pagoda dependency: run
the openapi strategy from an environment that has it, and point --python at the interpreter that has pagoda,
which serves the model:

    .venv/bin/python benchmarks/fuzz.py --strategy grammar --requests 10000 --json /tmp/fuzz-grammar.json
    python -m venv /tmp/fuzz && /tmp/fuzz/bin/pip install schemathesis
    /tmp/fuzz/bin/python benchmarks/fuzz.py --python .venv/bin/python --max-examples 200

or fuzz a server that is already running with --url (and --api-key if it has one). Either way the run stops
after --requests requests or --max-seconds, whichever comes first. The results JSON records the counts, the
findings, the source revision (and whether the tree was dirty) and the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from fuzz_grammar import fuzz_grammar
from provenance import write_result
from server_process import HOST, free_port, start_server, stop_server

# Small enough that any generated request finishes quickly on the built-in model; tools for tool_choice auto.
SERVE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "64", "--max-waiting-requests", "256",
              "--request-timeout", "20", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def start_pagoda(python: str, model: str | None, log_dir: Path) -> tuple[subprocess.Popen, str]:
    command = [python, "-m", "pagoda", "serve", "--host", HOST, "--port", str(free_port()), *SERVE_ARGS]
    if model:
        command += ["--model", model]
    return start_server(command, log_dir / "server.log", timeout=300,
                        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def served_model(url: str, headers: dict[str, str]) -> str:
    request = urllib.request.Request(f"{url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def run(args: argparse.Namespace, url: str, headers: dict[str, str]) -> dict:
    """The strategy's results: a summary, the failures that decide the exit code, and its details."""
    if args.strategy == "grammar":
        findings, leftover = fuzz_grammar(url, headers, served_model(url, headers), requests=args.requests,
                                          seconds=args.max_seconds, run_seed=args.seed, batch_size=args.batch_size,
                                          bystander_tokens=args.bystander_tokens)
        failures = findings.failures() + [f"{name} = {value} after the load" for name, value in leftover.items()
                                          if value != 0]
        return {"summary": findings.summary(), "failures": failures, "after": leftover,
                "by_family": {k: dict(v) for k, v in sorted(findings.by_family.items())},
                "by_carrier": {k: dict(v) for k, v in sorted(findings.by_carrier.items())},
                "problems": findings.problems}
    from fuzz_openapi import Budget, fuzz_openapi  # schemathesis: only in the environment that runs this strategy

    budget = Budget(args.max_examples, args.requests, time.monotonic() + args.max_seconds)
    openapi_findings = fuzz_openapi(url, headers, budget, args.seed)
    summary = openapi_findings.summary()
    return {"summary": summary, "failures": [f"{summary['findings']} findings"] if summary["findings"] else [],
            **openapi_findings.report()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("openapi", "grammar"), default="openapi")
    parser.add_argument("--url", help="fuzz this running server instead of starting one")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with pagoda, to start the server")
    parser.add_argument("--model", help="model directory to serve (default: the built-in model)")
    parser.add_argument("--api-key")
    parser.add_argument("--requests", type=int, default=sys.maxsize,
                        help="stop after this many requests (default: no bound but --max-seconds)")
    parser.add_argument("--max-seconds", type=float, default=4 * 3600.0, help="stop sending after this long")
    parser.add_argument("--max-examples", type=int, default=100,
                        help="openapi: requests per operation and generation mode")
    parser.add_argument("--batch-size", type=int, default=16, help="grammar: requests sent together per bystander")
    parser.add_argument("--bystander-tokens", type=int, default=200, help="grammar: the bystander's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the counts and findings here")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with tempfile.TemporaryDirectory(prefix="pagoda-fuzz-") as log_dir:
        process, url = (None, args.url) if args.url else start_pagoda(args.python, args.model, Path(log_dir))
        started = time.monotonic()
        try:
            result = run(args, url, headers)
        finally:
            if process is not None:
                stop_server(process, timeout=60)
        tracebacks = Path(log_dir, "server.log").read_text(errors="replace").count("Traceback") if process else 0
    result = {"strategy": args.strategy, "seconds": round(time.monotonic() - started, 1), **result,
              "server_log_tracebacks": tracebacks, "argv": sys.argv}
    report(result, args.json)
    return 1 if result["failures"] else 0


def report(result: dict, json_path: Path | None) -> None:
    summary = result["summary"]
    print(f"\n{summary['requests']} requests in {result['seconds']:.0f} s; by status: {summary['statuses']}")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("requests", "statuses")}))
    if result["server_log_tracebacks"]:
        print(f"server log: {result['server_log_tracebacks']} tracebacks")
    print(f"{len(result['failures'])} failures: {'; '.join(result['failures'])}")
    for problem in result["problems"][:20]:
        print("  ", json.dumps(problem)[:600])
    if json_path is not None:
        write_result(json_path, result, indent=1)
        print(f"wrote {json_path}")


if __name__ == "__main__":
    sys.exit(main())
