"""fuzz.py's openapi strategy: schemathesis generates requests from the server's own `/openapi.json`, for every
operation requests that follow the schema and requests that break it. A finding is any 5xx, an error whose
body is not OpenAI's shape, a response the schema does not document (status code, content type, headers, body
schema; schemathesis's conformance checks), or /health failing to answer 200 within its bound between
operations.

schemathesis is not a pagoda dependency: this module is imported only when the strategy runs.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from dataclasses import dataclass, field

import requests
import schemathesis
from http_checks import error_problem, health_problem
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# What the document promises about each response. Not "positive data acceptance": a request the schema
# allows may still be refused for what its values mean (a prompt longer than the context is a 400).
CONFORMANCE_CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
                      response_schema_conformance]


@dataclass
class Findings:
    counts: collections.Counter = field(default_factory=collections.Counter)  # (operation, mode, status) -> n
    problems: list[dict] = field(default_factory=list)

    def record(self, operation: str, mode: str, response: requests.Response, body: object) -> None:
        self.counts[(operation, mode, response.status_code)] += 1
        problem = error_problem(response.status_code, response.text)
        if problem is not None:
            self.problems.append({"operation": operation, "mode": mode, "status": response.status_code,
                                  "problem": problem, "request": body, "response": response.text[:500]})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        by_status: collections.Counter = collections.Counter()
        for (_, _, status), count in self.counts.items():
            by_status[status] += count
        return {"requests": self.total, "statuses": dict(sorted(by_status.items())),
                "server_errors": sum(count for status, count in by_status.items() if status >= 500),
                "findings": len(self.problems)}

    def report(self) -> dict:
        for (operation, mode, status), count in sorted(self.counts.items()):
            print(f"  {operation:32} {mode:9} {status}: {count}")
        counts = [{"operation": o, "mode": m, "status": s, "count": c} for (o, m, s), c in self.counts.items()]
        return {"counts": counts, "problems": self.problems}


@dataclass(frozen=True)
class Budget:
    max_examples: int  # per operation and generation mode
    requests: int  # in all
    deadline: float  # time.monotonic() after which nothing more is sent

    def spent(self, findings: Findings) -> bool:
        return findings.total >= self.requests or time.monotonic() > self.deadline


def fuzz_openapi(url: str, headers: dict[str, str], budget: Budget, run_seed: int) -> Findings:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    findings = Findings()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if budget.spent(findings):
                return findings
            _fuzz_operation(operation, mode, url, headers, session, findings, budget, run_seed)
            if (health := health_problem(url)) is not None:
                findings.problems.append({"operation": "/health", "problem": f"{health} after {operation.label} "
                                                                             f"({mode.value})"})
        print(f"{operation.label}: {findings.total} requests so far, {len(findings.problems)} findings", flush=True)
    return findings


def _fuzz_operation(operation, mode: GenerationMode, url: str, headers: dict[str, str], session: requests.Session,
                    findings: Findings, budget: Budget, run_seed: int) -> None:
    @seed(run_seed)
    @settings(max_examples=budget.max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def probe(case) -> None:
        if budget.spent(findings):
            return  # hypothesis still draws this operation's remaining examples; they are not sent
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


def _jsonable(value: object) -> object:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)[:2000]
    return value
