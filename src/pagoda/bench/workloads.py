"""Workloads: what to send. Seeded, built before the clock starts, independent of the load pattern.

Every workload is a list of conversations; a single-turn workload is conversations of one turn. A turn's
prompt is token ids (exact length; completions only), text, or a list of chat messages (JSONL only).

- random: prompts of random ordinary token ids with lengths drawn from fixed / uniform / normal.
- shared-prefix: `num_prefix_groups` random prefixes of `prefix_len` tokens; each prompt is its group's
  prefix followed by a random suffix of the input length (prefix caching is what this measures).
- multi-turn: conversations of `num_turns` user turns of random text; each turn resends the conversation
  so far, with the server's earlier answers in it.
- jsonl: one JSON object a line: {"prompt": text} or {"prompt_token_ids": [...]} or {"messages": [...]},
  optionally with "max_tokens", "priority" and "tenant"; lines are used in order, cycling when there are fewer than
  requests.

With a priority mix (`--priority-mix 0=3,1=1`), each conversation draws a priority, sent as vLLM's `priority`
field; `pagoda bench` then reports latencies per priority (bench/classes.py). A tenant mix
(`--tenant-mix alice=3,bob=1`) draws a tenant per conversation the same way, sent in a header or as that
tenant's API key (bench/client.py), and reported per tenant.

For chat, token ids are decoded to text (random ids do not survive decode -> encode), so chat prompt lengths
come from the server's `usage` (or its `/tokenize`), not from the asked length.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from pagoda.bench.tokens import ClientTokenizer

KINDS = ("random", "shared-prefix", "multi-turn", "jsonl")
LENGTH_DISTRIBUTIONS = ("fixed", "uniform", "normal")

Prompt = list[int] | str | list[dict[str, Any]]


def is_messages(prompt: Prompt) -> TypeGuard[list[dict[str, Any]]]:
    """Chat messages, rather than text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


@dataclass
class Turn:
    prompt: Prompt
    max_tokens: int
    expected_prompt_tokens: int | None = None  # the client's count of what the server will see
    priority: int | None = None  # vLLM's request priority (None: not sent)
    tenant: str | None = None  # the tenant it is sent for (None: none named)


@dataclass
class Conversation:
    index: int
    turns: list[Turn] = field(default_factory=list)
    group: int | None = None  # shared-prefix group


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    input_len: int = 128
    input_dist: str = "fixed"
    input_spread: float = 0.0  # uniform: +- this fraction of input_len; normal: std = this fraction
    output_len: int = 32
    output_dist: str = "fixed"
    output_spread: float = 0.0
    num_prefix_groups: int = 4
    prefix_len: int = 64
    num_turns: int = 3
    path: str | None = None
    # (priority, weight) pairs: each conversation draws its priority from them (a JSONL line's own wins)
    priority_mix: tuple[tuple[int, float], ...] = ()
    # (tenant, weight) pairs: each conversation draws the tenant it is sent for
    tenant_mix: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {', '.join(KINDS)}, not {self.kind!r}")
        for dist in (self.input_dist, self.output_dist):
            if dist not in LENGTH_DISTRIBUTIONS:
                raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTRIBUTIONS)}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input and output lengths must be at least 1")
        if self.kind == "jsonl" and not self.path:
            raise ValueError("the jsonl workload needs a file (--dataset)")
        if any(weight <= 0 for _, weight in (*self.priority_mix, *self.tenant_mix)):
            raise ValueError("priority and tenant weights must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def sample_lengths(count: int, mean: int, dist: str, spread: float, rng: random.Random) -> list[int]:
    """`count` lengths >= 1 around `mean`: fixed; uniform in mean*(1 +- spread); normal with std mean*spread."""
    if dist == "fixed" or spread <= 0:
        return [mean] * count
    if dist == "uniform":
        low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
        return [rng.randint(low, high) for _ in range(count)]
    if dist == "normal":
        return [max(1, round(rng.gauss(mean, mean * spread))) for _ in range(count)]
    raise ValueError(f"unknown length distribution {dist!r}")


def parse_priority_mix(text: str | None) -> tuple[tuple[int, float], ...]:
    """`0=3,1=1` -> ((0, 3.0), (1, 1.0)): priorities and their relative weights."""
    mix = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        priority, _, weight = part.partition("=")
        try:
            mix.append((int(priority), float(weight or 1)))
        except ValueError:
            raise ValueError(f"bad priority mix entry {part!r}: expected PRIORITY=WEIGHT, e.g. 0=3,1=1") from None
    return tuple(mix)


def parse_tenant_mix(text: str | None) -> tuple[tuple[str, float], ...]:
    """`alice=3,bob=1` -> (("alice", 3.0), ("bob", 1.0)): tenants and their relative weights (default 1)."""
    mix = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, weight = part.partition("=")
        try:
            mix.append((name.strip(), float(weight or 1)))
        except ValueError:
            raise ValueError(f"bad tenant mix entry {part!r}: expected NAME=WEIGHT, e.g. alice=3,bob=1") from None
        if not mix[-1][0]:
            raise ValueError(f"bad tenant mix entry {part!r}: no tenant name")
    return tuple(mix)


def build_workload(spec: WorkloadSpec, num_requests: int, tokenizer: ClientTokenizer | None, api: str,
                   seed: int) -> list[Conversation]:
    """Conversations holding `num_requests` turns in all (multi-turn: the last conversation may be shorter),
    each conversation's turns at the priority, and for the tenant, it drew from the mixes (when there are)."""
    conversations = _conversations(spec, num_requests, tokenizer, api, seed)
    if spec.tenant_mix:
        rng = random.Random(f"tenant-{seed}")  # its own stream, as the priorities'
        names, shares = [n for n, _ in spec.tenant_mix], [w for _, w in spec.tenant_mix]
        for conversation in conversations:
            tenant = rng.choices(names, shares)[0]
            for turn in conversation.turns:
                turn.tenant = tenant if turn.tenant is None else turn.tenant
    if spec.priority_mix:
        rng = random.Random(f"priority-{seed}")  # its own stream: the prompts do not change with the mix
        priorities = [p for p, _ in spec.priority_mix]
        weights = [w for _, w in spec.priority_mix]
        for conversation in conversations:
            drawn = rng.choices(priorities, weights)[0]
            for turn in conversation.turns:
                turn.priority = drawn if turn.priority is None else turn.priority
    return conversations


def _conversations(spec: WorkloadSpec, num_requests: int, tokenizer: ClientTokenizer | None, api: str,
                   seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    if spec.kind == "jsonl":
        return _jsonl(spec, num_requests, tokenizer, api)
    if tokenizer is None:
        raise ValueError(f"the {spec.kind} workload needs a tokenizer (--tokenizer DIR)")
    inputs = sample_lengths(num_requests, spec.input_len, spec.input_dist, spec.input_spread, rng)
    outputs = sample_lengths(num_requests, spec.output_len, spec.output_dist, spec.output_spread, rng)
    if spec.kind == "random":
        return [Conversation(i, [_ids_turn(tokenizer.random_ids(rng, n), m, tokenizer, api)])
                for i, (n, m) in enumerate(zip(inputs, outputs))]
    if spec.kind == "shared-prefix":
        prefixes = [tokenizer.random_ids(rng, spec.prefix_len) for _ in range(spec.num_prefix_groups)]
        conversations = []
        for i, (n, m) in enumerate(zip(inputs, outputs)):
            group = rng.randrange(spec.num_prefix_groups)
            turn = _ids_turn(prefixes[group] + tokenizer.random_ids(rng, n), m, tokenizer, api)
            conversations.append(Conversation(i, [turn], group))
        return conversations
    return _multi_turn(spec, inputs, outputs, tokenizer, rng)


def _ids_turn(token_ids: list[int], max_tokens: int, tokenizer: ClientTokenizer, api: str) -> Turn:
    if api == "completions":
        return Turn(token_ids, max_tokens, expected_prompt_tokens=len(token_ids))
    return Turn(tokenizer.decode(token_ids), max_tokens)


def _multi_turn(spec: WorkloadSpec, inputs: list[int], outputs: list[int], tokenizer: ClientTokenizer,
                rng: random.Random) -> list[Conversation]:
    conversations: list[Conversation] = []
    for start in range(0, len(inputs), spec.num_turns):
        conversation = Conversation(len(conversations))
        for n, m in zip(inputs[start : start + spec.num_turns], outputs[start : start + spec.num_turns]):
            conversation.turns.append(Turn(tokenizer.decode(tokenizer.random_ids(rng, n)), m))
        conversations.append(conversation)
    return conversations


def _jsonl(spec: WorkloadSpec, num_requests: int, tokenizer: ClientTokenizer | None, api: str) -> list[Conversation]:
    if spec.path is None:
        raise ValueError("a jsonl workload needs a path")
    entries = []
    for number, line in enumerate(Path(spec.path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{spec.path}:{number}: not JSON ({error})") from error
        entries.append(_jsonl_turn(entry, spec, tokenizer, api, f"{spec.path}:{number}"))
    if not entries:
        raise ValueError(f"{spec.path}: no prompts")
    # A copy a conversation: the priority and tenant it draws are its own, though lines repeat.
    return [Conversation(i, [replace(entries[i % len(entries)])]) for i in range(num_requests)]


def _jsonl_turn(entry: dict[str, Any], spec: WorkloadSpec, tokenizer: ClientTokenizer | None, api: str,
                where: str) -> Turn:
    max_tokens = int(entry.get("max_tokens", entry.get("output_len", spec.output_len)))
    priority = int(entry["priority"]) if entry.get("priority") is not None else None
    turn = _jsonl_prompt(entry, max_tokens, tokenizer, api, where)
    turn.priority = priority
    turn.tenant = str(entry["tenant"]) if entry.get("tenant") is not None else None
    return turn


def _jsonl_prompt(entry: dict[str, Any], max_tokens: int, tokenizer: ClientTokenizer | None, api: str,
                  where: str) -> Turn:
    if "prompt_token_ids" in entry:
        ids = [int(t) for t in entry["prompt_token_ids"]]
        if api == "completions":
            return Turn(ids, max_tokens, len(ids))
        if tokenizer is None:
            raise ValueError(f"{where}: token ids for chat need a tokenizer to decode them")
        return Turn(tokenizer.decode(ids), max_tokens)
    if "messages" in entry:
        if api != "chat":
            raise ValueError(f"{where}: messages need --api chat")
        return Turn(list(entry["messages"]), max_tokens)
    if "prompt" in entry:
        text = str(entry["prompt"])
        expected = tokenizer.count(text, add_special_tokens=True) if tokenizer and api == "completions" else None
        return Turn(text, max_tokens, expected)
    raise ValueError(f"{where}: expected one of prompt, prompt_token_ids, messages")
