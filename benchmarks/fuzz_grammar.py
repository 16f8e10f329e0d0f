"""fuzz.py's grammar strategy: requests from grammar_poisons.py in small concurrent batches, each batch beside
a bystander stream that must come through untouched.

The bystander is greedy, on a fixed prompt, with `ignore_eos` and enough tokens to outlast the batch; its text
is first taken alone (twice: it must be the same, or comparing against it would prove nothing). Per batch it
starts first; once its first token has arrived the batch is sent, and when all are answered the bystander must
have finished with `finish_reason: "length"`, its full token count and the reference text. One that ends
otherwise (an error status or event, fewer tokens, a broken connection) is *lost*; one that completes with
other text *diverged*. A batch *overlapped* when the bystander was still streaming after every answer of the
batch had arrived: the engine held it while it held them. A 5xx that the server marks as confined to its own
request (failed alone) is a finding only when the constraint was well-formed.

Standard library only (the HTTP client is http.client), like the modules it uses.
"""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from grammar_poisons import GrammarCase, grammar_case
from http_checks import Reply, error_problem, health_problem, metric_sum, post

BYSTANDER_PROMPT = "Repeat exactly: k5ad boston 3qxofb"
MAX_PROBLEMS = 200  # kept in full in the results; the counts cover everything
START_TIMEOUT_S = 60.0


@dataclass
class StreamResult:
    text: str
    completion_tokens: int | None
    finish_reason: str | None
    failure: str | None  # why the stream did not complete, None when it did
    ended_at: float


class Bystander:
    """One greedy completion stream, run alone or beside other requests on its own thread."""

    def __init__(self, url: str, headers: dict[str, str], model: str, max_tokens: int) -> None:
        self.url, self.headers, self.max_tokens = url, headers, max_tokens
        self.body = {"model": model, "prompt": BYSTANDER_PROMPT, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        self._thread: threading.Thread | None = None
        self._first_token = threading.Event()
        self._got_token = False
        self._result: StreamResult | None = None

    def run(self) -> StreamResult:
        reply = post(self.url, "/v1/completions", self.body, self.headers, on_event=self._on_event)
        self._first_token.set()  # also when no token ever comes: start() must not wait forever
        return _stream_result(reply)

    def _on_event(self, event: Any) -> None:
        if isinstance(event, dict) and event.get("choices"):
            self._got_token = True
            self._first_token.set()

    def start(self) -> bool:
        """Start the stream; True once its first token arrived (False if it ended or timed out first)."""
        self._first_token.clear()
        self._got_token, self._result = False, None

        def target() -> None:
            self._result = self.run()

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()
        return self._first_token.wait(START_TIMEOUT_S) and self._got_token

    def finish(self) -> StreamResult:
        assert self._thread is not None, "start() first"
        self._thread.join()
        assert self._result is not None
        return self._result


def _stream_result(reply: Reply) -> StreamResult:
    text, tokens, finish, failure = [], None, None, None
    if reply.status != 200:
        failure = reply.transport_error or f"status {reply.status}: {reply.text[:300]}"
    elif reply.error_events:
        failure = f"error event: {json.dumps(reply.error_events[0])[:300]}"
    for event in reply.events:
        if not isinstance(event, dict):
            continue
        for choice in event.get("choices") or []:
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
    return StreamResult("".join(text), tokens, finish, failure, reply.finished_at)


def judge(result: StreamResult, reference: StreamResult, max_tokens: int) -> str | None:
    """None when the bystander completed as it did alone; else "lost: ..." or "diverged: ..."."""
    if result.failure is not None:
        return f"lost: {result.failure}"
    if result.finish_reason != "length" or result.completion_tokens != max_tokens:
        return f"lost: finish_reason {result.finish_reason}, {result.completion_tokens} of {max_tokens} tokens"
    if result.text != reference.text:
        return f"diverged: {result.text[:120]!r} instead of {reference.text[:120]!r}"
    return None


@dataclass
class GrammarFindings:
    statuses: collections.Counter = field(default_factory=collections.Counter)  # outcome label -> n
    by_family: dict[str, collections.Counter] = field(default_factory=dict)  # family -> outcome label -> n
    by_carrier: dict[str, collections.Counter] = field(default_factory=dict)
    requests: int = 0
    server_errors: int = 0
    failed_alone: int = 0  # of the server errors, those of hostile constraints marked as confined to themselves
    transport_errors: int = 0
    misshapen_errors: int = 0  # 4xx bodies not in OpenAI's error shape
    batches: int = 0
    bystanders_lost: int = 0
    bystanders_diverged: int = 0
    bystanders_not_started: int = 0
    batches_overlapped: int = 0
    health_failures: int = 0
    problems: list[dict] = field(default_factory=list)

    def problem(self, entry: dict) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(entry)

    def record(self, case: GrammarCase, reply: Reply) -> None:
        label = reply.outcome()
        self.requests += 1
        self.statuses[label] += 1
        self.by_family.setdefault(case.family, collections.Counter())[label] += 1
        self.by_carrier.setdefault(case.carrier, collections.Counter())[label] += 1
        self.server_errors += reply.server_error()
        alone = case.hostile and reply.failed_alone()
        self.failed_alone += alone
        self.transport_errors += reply.status is None
        problem = reply.transport_error if reply.status is None else error_problem(reply.status, reply.text)
        if problem is None and reply.server_error():
            problem = "server error in the stream"
        if alone:
            problem = f"{problem}, failed alone"
        self.misshapen_errors += problem == "error body is not OpenAI's shape"
        if problem is not None:
            self.problem({"problem": problem, "family": case.family, "carrier": case.carrier, "route": case.route,
                          "outcome": label, "response": (reply.text or json.dumps(reply.error_events))[:500],
                          "request": json.dumps(case.body)[:2000]})

    def summary(self) -> dict:
        counts = {name: getattr(self, name) for name in (
            "requests", "server_errors", "failed_alone", "transport_errors", "misshapen_errors", "batches",
            "bystanders_lost", "bystanders_diverged", "bystanders_not_started", "batches_overlapped",
            "health_failures")}
        return {**counts, "statuses": dict(sorted(self.statuses.items()))}

    def failures(self) -> list[str]:
        counts = {"5xx answers (not hostile requests failing alone)": self.server_errors - self.failed_alone,
                  "transport errors": self.transport_errors,
                  "errors not in OpenAI's shape": self.misshapen_errors, "bystanders lost": self.bystanders_lost,
                  "bystanders diverged": self.bystanders_diverged,
                  "bystanders that never started": self.bystanders_not_started,
                  "/health failures": self.health_failures}
        return [f"{count} {what}" for what, count in counts.items() if count]


def fuzz_grammar(url: str, headers: dict[str, str], model: str, *, requests: int, seconds: float, run_seed: int,
                 batch_size: int, bystander_tokens: int) -> tuple[GrammarFindings, dict]:
    """Send up to `requests` grammar cases (for at most `seconds`) in batches beside a bystander. Returns the
    findings and what the server held once the load stopped (running, waiting requests, KV usage)."""
    bystander = Bystander(url, headers, model, bystander_tokens)
    reference = bystander.run()
    again = bystander.run()
    for alone in (reference, again):
        if (problem := judge(alone, reference, bystander_tokens)) is not None:
            raise RuntimeError(f"the bystander alone does not complete the same way twice: {problem}")
    print(f"bystander alone: {bystander_tokens} tokens, {reference.text[:60]!r}...", flush=True)
    rng, findings = random.Random(run_seed), GrammarFindings()
    deadline = time.monotonic() + seconds
    with ThreadPoolExecutor(batch_size) as pool:
        while findings.requests < requests and time.monotonic() < deadline:
            cases = [grammar_case(rng, model) for _ in range(min(batch_size, requests - findings.requests))]
            _run_batch(url, headers, cases, bystander, reference, pool, findings)
            if findings.batches % 25 == 0:
                print(f"{findings.requests} requests: {findings.server_errors} 5xx, {findings.bystanders_lost} "
                      f"bystanders lost", flush=True)
    time.sleep(2)  # aborted requests drain
    leftover = {name: metric_sum(url, name) for name in
                ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    return findings, leftover


def _run_batch(url: str, headers: dict[str, str], cases: list[GrammarCase], bystander: Bystander,
               reference: StreamResult, pool: ThreadPoolExecutor, findings: GrammarFindings) -> None:
    findings.batches += 1
    families = [f"{case.family} via {case.carrier}" for case in cases]
    started = bystander.start()
    replies = list(pool.map(lambda case: post(url, case.route, case.body, headers), cases))
    result = bystander.finish()
    for case, reply in zip(cases, replies):
        findings.record(case, reply)
    verdict = judge(result, reference, bystander.max_tokens)
    if not started and verdict is None:
        findings.bystanders_not_started += 1
        findings.problem({"problem": "bystander did not start within the bound", "batch": families})
    if verdict is not None:
        findings.bystanders_lost += verdict.startswith("lost")
        findings.bystanders_diverged += verdict.startswith("diverged")
        findings.problem({"problem": f"bystander {verdict}", "batch": families,
                          "outcomes": [reply.outcome() for reply in replies]})
    elif result.ended_at > max(reply.finished_at for reply in replies):
        findings.batches_overlapped += 1
    if (health := health_problem(url)) is not None:
        findings.health_failures += 1
        findings.problem({"problem": health, "after batch": families})
