"""The requests a soak sends: ordinary ones (streamed or not, some dropped mid-flight), hostile ones that must
get a 4xx, output-constraint poisons that must get a 4xx or fail alone, and the per-level tally they feed."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from grammar_poisons import CARRIERS, FAMILIES, HOSTILE_FAMILIES, grammar_case
from http_checks import ERROR_SCOPE_HEADER, REQUEST_SCOPE, error_problem

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "victor", "zulu")
# (name, request arguments for httpx): each must be refused with a 4xx and leave the server as it was.
HOSTILE: tuple[tuple[str, dict], ...] = (
    ("invalid JSON", {"content": b'{"prompt": "a", "max_tokens": ', "headers": {"content-type": "application/json"}}),
    ("lone surrogate", {"content": b'{"model": "M", "prompt": "\\ud800", "max_tokens": 4}',
                        "headers": {"content-type": "application/json"}}),
    ("string for a bool", {"json": {"model": "M", "prompt": "a", "stream": "yes"}}),
    ("negative max_tokens", {"json": {"model": "M", "prompt": "a", "max_tokens": -1}}),
    ("fan-out past the bound", {"json": {"model": "M", "prompt": ["a"] * 64, "n": 64, "max_tokens": 4}}),
    ("prompt too long", {"json": {"model": "M", "prompt": "word " * 40_000, "max_tokens": 4}}),
    ("too many stop strings", {"json": {"model": "M", "prompt": "a", "stop": [f"s{i}" for i in range(100)]}}),
    ("huge logit_bias", {"json": {"model": "M", "prompt": "a", "logit_bias": {str(i): 1 for i in range(5000)}}}),
    ("unknown model", {"json": {"model": "no-such-model", "prompt": "a", "max_tokens": 4}}),
)


@dataclass
class Level:
    multiple: float
    rate: float
    seconds: float
    statuses: dict[int, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    completed: int = 0
    usage_checked: int = 0
    disconnected: int = 0
    hostile: int = 0
    poisons: int = 0  # of the hostile requests, those from grammar_poisons.py
    poisons_failed_alone: int = 0  # a 5xx or error event that the server confined to the poison's own request
    problems: list[str] = field(default_factory=list)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def report(self) -> dict:
        sent = sum(self.statuses.values()) + self.disconnected
        ttft = sorted(self.ttft)
        return {"multiple": self.multiple, "offered_rps": round(self.rate, 3), "seconds": round(self.seconds),
                "requests": sent, "completed": self.completed, "completed_rps": round(self.completed / self.seconds, 3),
                "rate_429": round(self.statuses.get(429, 0) / max(1, sent), 4), "statuses": self.statuses,
                "disconnected": self.disconnected, "hostile": self.hostile, "poisons": self.poisons,
                "poisons_failed_alone": self.poisons_failed_alone, "usage_checked": self.usage_checked,
                "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p99_s": _quantile(ttft, 0.99), "problems": self.problems}


def _quantile(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def ordinary_body(rng: random.Random, model: str) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 16, 48, 96))))
    return {"model": model, "prompt": prompt, "max_tokens": rng.choice((1, 8, 32, 96)), "temperature": 1.0,
            "seed": rng.randrange(1 << 30), "logprobs": 0, "stream": rng.random() < 0.5,
            "stream_options": None}


async def send_ordinary(client: httpx.AsyncClient, body: dict, level: Level, drop_after: float | None) -> None:
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    else:
        del body["stream_options"]
    started = time.monotonic()
    try:
        request = client.stream("POST", "/v1/completions", json=body)
        if drop_after is not None:
            await asyncio.wait_for(_consume(request, body, level, started), drop_after)
        else:
            await _consume(request, body, level, started)
    except TimeoutError:
        level.disconnected += 1  # the client gave up: the server must abort the request and free its blocks
    except httpx.HTTPError as error:
        level.problems.append(f"transport error: {error!r}")


async def _consume(request, body: dict, level: Level, started: float) -> None:
    async with request as response:
        level.count(response.status_code)
        if response.status_code != 200:
            await response.aread()
            # An ordinary request is only ever refused for load (429): anything else is a finding.
            if response.status_code != 429 or error_problem(response.status_code, response.text):
                level.problems.append(f"{response.status_code}: {response.text[:300]}")
            return
        if not body["stream"]:
            data = json.loads(await response.aread())
            tokens = sum(len(choice["logprobs"]["tokens"]) for choice in data["choices"])
            _check_usage(level, data["usage"], tokens)
            return
        tokens, usage = 0, None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                level.problems.append(f"stream error: {line[:300]}")
                return
            for choice in chunk["choices"]:
                if tokens == 0 and choice.get("logprobs"):
                    level.ttft.append(time.monotonic() - started)
                tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            usage = chunk.get("usage") or usage
        _check_usage(level, usage, tokens)


def _check_usage(level: Level, usage: dict | None, tokens: int) -> None:
    level.completed += 1
    level.usage_checked += 1
    if usage is None or usage["completion_tokens"] != tokens:
        level.problems.append(f"usage {usage} but {tokens} tokens received")


async def send_hostile(client: httpx.AsyncClient, rng: random.Random, model: str, level: Level) -> None:
    pick = rng.randrange(len(HOSTILE) + len(HOSTILE_FAMILIES))
    if pick >= len(HOSTILE):
        await send_poison(client, rng, model, level, HOSTILE_FAMILIES[pick - len(HOSTILE)])
    else:
        await send_refused(client, model, level, *HOSTILE[pick])


async def send_refused(client: httpx.AsyncClient, model: str, level: Level, name: str, arguments: dict) -> None:
    """One of HOSTILE: it must get a 4xx in OpenAI's error shape."""
    arguments = json.loads(json.dumps(arguments, default=lambda b: b.decode()).replace('"M"', json.dumps(model)))
    if isinstance(arguments.get("content"), str):
        arguments["content"] = arguments["content"].encode()
    level.hostile += 1
    try:
        response = await client.post("/v1/completions", **arguments)
    except httpx.HTTPError as error:
        level.problems.append(f"hostile {name}: transport error {error!r}")
        return
    level.count(response.status_code)
    if not 400 <= response.status_code < 500 or error_problem(response.status_code, response.text):
        level.problems.append(f"hostile {name}: {response.status_code} {response.text[:200]}")


async def send_poison(client: httpx.AsyncClient, rng: random.Random, model: str, level: Level, family: str) -> None:
    """A hostile output constraint: refused with a 4xx, completed, or failed alone (a 5xx, or an error event in
    its own stream, that the server marks as confined to this request)."""
    case = grammar_case(rng, model, family)
    name = f"{family} via {case.carrier}"
    level.hostile += 1
    level.poisons += 1
    try:
        # Encoded here, ASCII-escaped: a poison may hold a lone surrogate, which httpx's json= cannot encode.
        body = json.dumps(case.body).encode()
        async with client.stream("POST", case.route, content=body,
                                 headers={"content-type": "application/json"}) as response:
            text = (await response.aread()).decode(errors="replace")
    except httpx.HTTPError as error:
        level.problems.append(f"hostile {name}: transport error {error!r}")
        return
    level.count(response.status_code)
    errors = [json.loads(line[6:])["error"] for line in text.splitlines() if line.startswith('data: {"error"')]
    if response.status_code == 200 and not errors:
        return
    if response.status_code == 200 or response.status_code >= 500:
        scopes = ({error.get("scope") if isinstance(error, dict) else None for error in errors}
                  or {response.headers.get(ERROR_SCOPE_HEADER)})
        if scopes == {REQUEST_SCOPE}:
            level.poisons_failed_alone += 1
            return
    elif error_problem(response.status_code, text) is None:
        return
    level.problems.append(f"hostile {name}: {response.status_code} {text[:200]} for {json.dumps(case.body)[:300]}")


async def warm_up(url: str, model: str) -> Level:
    """Each kind of request the soak sends, before idle memory is first read: what a first use initialises
    once (the grammar engine, each constraint carrier's path, each refusal's) is not growth."""
    level, rng = Level(0, 0, 0), random.Random(7)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        for body in (ordinary_body(rng, model) for _ in range(8)):
            await send_ordinary(client, body, level, None)
        for name, arguments in HOSTILE:
            await send_refused(client, model, level, name, arguments)
        for family in FAMILIES:
            for _ in range(2 * len(CARRIERS[FAMILIES[family].kind])):
                await send_poison(client, rng, model, level, family)
    return level
