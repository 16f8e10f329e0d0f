"""Fuzz `pagoda serve` through its own OpenAPI schema with schemathesis: for every operation, requests that
follow the schema and requests that break it. A finding is any 5xx, an error whose body is not OpenAI's
{"error": {"message", "type", "param", "code"}}, a response the schema does not document (status code,
content type, headers, body schema; schemathesis's conformance checks), or /health failing to answer 200
within a second between operations.

schemathesis is not a pagoda dependency: run this script from an environment that has it (it imports
nothing of pagoda), and point --python at the interpreter that has pagoda, which serves the model:

    python -m venv /tmp/fuzz && /tmp/fuzz/bin/pip install schemathesis
    /tmp/fuzz/bin/python benchmarks/fuzz.py --python .venv/bin/python --max-examples 200

or fuzz a server that is already running with --url (and --api-key if it has one).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_process import HOST, free_port, start_server, stop_server

HEALTH_BOUND_S = 1.0
# What the document promises about each response. Not "positive data acceptance": a request the schema
# allows may still be refused for what its values mean (a prompt longer than the context is a 400).
CONFORMANCE_CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
                      response_schema_conformance]
ERROR_KEYS = {"message", "type", "param", "code"}
# Small enough that any generated request finishes quickly on the built-in model.
SERVE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "64", "--max-waiting-requests", "256",
              "--request-timeout", "20")


@dataclass
class Findings:
    counts: collections.Counter = field(default_factory=collections.Counter)  # (operation, mode, status) -> n
    problems: list[dict] = field(default_factory=list)

    def record(self, operation: str, mode: str, response: requests.Response, body: object) -> None:
        self.counts[(operation, mode, response.status_code)] += 1
        problem = _problem(response)
        if problem is not None:
            self.problems.append({"operation": operation, "mode": mode, "status": response.status_code,
                                  "problem": problem, "request": body, "response": response.text[:500]})

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _problem(response: requests.Response) -> str | None:
    if response.status_code >= 500:
        return "server error"
    if response.status_code < 400:
        return None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "error body is not OpenAI's shape"
    if not isinstance(error, dict) or not set(error) >= ERROR_KEYS or error["code"] != response.status_code:
        return "error body is not OpenAI's shape"
    return None


def fuzz(url: str, headers: dict[str, str], max_examples: int, run_seed: int) -> Findings:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    findings = Findings()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            _fuzz_operation(operation, mode, url, headers, session, findings, max_examples, run_seed)
            _check_health(url, findings, f"after {operation.label} ({mode.value})")
        print(f"{operation.label}: {findings.total} requests so far, {len(findings.problems)} findings", flush=True)
    return findings


def _fuzz_operation(operation, mode: GenerationMode, url: str, headers: dict[str, str], session: requests.Session,
                    findings: Findings, max_examples: int, run_seed: int) -> None:
    @seed(run_seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def probe(case) -> None:
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=60)
        except requests.RequestException as error:
            findings.problems.append({"operation": operation.label, "mode": mode.value, "problem": repr(error),
                                      "request": _jsonable(case.body)})
            return
        findings.record(operation.label, mode.value, response, _jsonable(case.body))
        try:
            case.validate_response(response, checks=CONFORMANCE_CHECKS, headers=headers)
        except Exception as failure:  # schemathesis raises its failures (one or a group) under several types
            findings.problems.append({"operation": operation.label, "mode": mode.value, "status":
                                      response.status_code, "problem": f"conformance: {str(failure)[:400]}",
                                      "request": _jsonable(case.body)})

    with contextlib.suppress(Unsatisfiable):  # nothing to break: an operation without parameters, negative mode
        probe()


def _check_health(url: str, findings: Findings, when: str) -> None:
    started = time.monotonic()
    try:
        status = requests.get(f"{url}/health", timeout=10).status_code
    except requests.RequestException as error:
        status = repr(error)
    elapsed = time.monotonic() - started
    if status != 200 or elapsed > HEALTH_BOUND_S:
        findings.problems.append({"operation": "/health", "problem": f"{status} in {elapsed:.2f} s {when}"})


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)[:2000]
    return value


# --- the server ----------------------------------------------------------------------------------------------


def start_pagoda(python: str, model: str | None, log_dir: Path) -> tuple[subprocess.Popen, str]:
    command = [python, "-m", "pagoda", "serve", "--host", HOST, "--port", str(free_port()), *SERVE_ARGS]
    if model:
        command += ["--model", model]
    return start_server(command, log_dir / "server.log", timeout=300,
                        env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="fuzz this running server instead of starting one")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with pagoda, to start the server")
    parser.add_argument("--model", help="model directory to serve (default: the built-in model)")
    parser.add_argument("--api-key")
    parser.add_argument("--max-examples", type=int, default=100, help="requests per operation and generation mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the counts and findings here")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with tempfile.TemporaryDirectory(prefix="pagoda-fuzz-") as log_dir:
        process, url = (None, args.url) if args.url else start_pagoda(args.python, args.model, Path(log_dir))
        started = time.monotonic()
        try:
            findings = fuzz(url, headers, args.max_examples, args.seed)
        finally:
            if process is not None:
                stop_server(process, timeout=60)
                if findings_log := Path(log_dir, "server.log").read_text(errors="replace").count("Traceback"):
                    print(f"server log: {findings_log} tracebacks")
    report(findings, time.monotonic() - started, args.json)
    return 1 if findings.problems else 0


def report(findings: Findings, seconds: float, json_path: Path | None) -> None:
    by_status = collections.Counter()
    for (_, _, status), count in findings.counts.items():
        by_status[status] += count
    print(f"\n{findings.total} requests in {seconds:.0f} s; by status: {dict(sorted(by_status.items()))}")
    for (operation, mode, status), count in sorted(findings.counts.items()):
        print(f"  {operation:32} {mode:9} {status}: {count}")
    print(f"{len(findings.problems)} findings")
    for problem in findings.problems[:20]:
        print("  ", json.dumps(problem)[:600])
    if json_path is not None:
        counts = [{"operation": o, "mode": m, "status": s, "count": c} for (o, m, s), c in findings.counts.items()]
        json_path.write_text(json.dumps({"counts": counts, "problems": findings.problems}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
