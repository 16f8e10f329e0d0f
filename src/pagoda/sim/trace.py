"""A multi-turn chat trace, generated from a seed: the workload a simulated fleet and a real one both replay.

Conversations arrive as a Poisson process, at `conversation_rate`, or at `burst_rate` for `burst_duration_s` from
`burst_start_s` (a burst, or a lull). Each opens with one of a few system prompts (Zipf popularity, so that
some prefixes are hot) and runs several turns; turn k's prompt is the system prompt, then every earlier
turn's user message and recorded answer, then its own user message: a conversation replayed from a log, as
a chat client resends it. Each turn asks for its recorded answer's length (ignore_eos), and the next turn is
sent a think time after the answer ends. Token ids are drawn from [FIRST_TOKEN_ID, vocab_size), clear of a
tokenizer's special ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

FIRST_TOKEN_ID = 16


@dataclass(frozen=True)
class TraceConfig:
    num_conversations: int = 200
    conversation_rate: float = 2.0  # conversations started per second (Poisson)
    min_turns: int = 2
    max_turns: int = 5
    num_system_prompts: int = 8
    system_prompt_zipf: float = 1.0  # popularity of system prompt i ~ 1 / (i + 1) ** s
    system_prompt_tokens: int = 256
    user_tokens: tuple[int, int] = (32, 128)  # uniform, both ends included
    answer_tokens: tuple[int, int] = (16, 64)
    mean_think_s: float = 3.0  # exponential
    vocab_size: int = 32000
    seed: int = 0
    burst_start_s: float = 0.0
    burst_duration_s: float = 0.0  # 0: no burst
    burst_rate: float = 0.0  # conversations started per second during the burst

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_system_prompts < 1 or self.system_prompt_tokens < 1:
            raise ValueError("num_conversations, num_system_prompts and system_prompt_tokens must be at least 1")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("turns must satisfy 1 <= min_turns <= max_turns")
        if not self.conversation_rate > 0 or not self.mean_think_s >= 0:
            raise ValueError("conversation_rate must be > 0 and mean_think_s >= 0")
        for name in ("user_tokens", "answer_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high")
        burst = self.burst_rate > 0 and self.burst_start_s >= 0 and self.burst_duration_s > 0
        if self.burst_duration_s and not burst:
            raise ValueError("a burst needs burst_rate > 0, burst_start_s >= 0 and burst_duration_s > 0")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be above {FIRST_TOKEN_ID}")

    def next_arrival(self, rng: random.Random, now: float) -> float:
        """The next conversation's start after `now`: exponential gaps at the rate in force; a gap that crosses the
        burst's start or end is drawn again from there (the process is memoryless, so this is exact)."""
        end = self.burst_start_s + self.burst_duration_s
        while True:
            in_burst = self.burst_start_s <= now < end
            arrival = now + rng.expovariate(self.burst_rate if in_burst else self.conversation_rate)
            edge = end if in_burst else self.burst_start_s
            if not self.burst_duration_s or not now < edge <= arrival:
                return arrival
            now = edge

    @property
    def longest_prompt(self) -> int:
        """The most tokens a turn's prompt and answer can hold: what max_model_len must allow."""
        per_turn = self.user_tokens[1] + self.answer_tokens[1]
        return self.system_prompt_tokens + self.max_turns * per_turn


@dataclass(frozen=True)
class Turn:
    user_len: int
    answer_len: int  # the recorded answer's length: the request's max_tokens
    think_s: float  # after this turn's answer, before the next turn is sent


@dataclass(frozen=True)
class Conversation:
    conversation_id: int
    start_s: float
    system_prompt: int  # index into Trace.system_prompts
    turns: tuple[Turn, ...]


@dataclass
class Trace:
    """The conversations hold lengths only; a turn's tokens are drawn when it is sent (`turn_tokens`, seeded by the
    conversation and turn), so that a trace of many thousand conversations stays small."""

    config: TraceConfig
    system_prompts: list[list[int]]
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(conversation.turns) for conversation in self.conversations)

    def turn_tokens(self, conversation: Conversation, turn_index: int) -> tuple[list[int], list[int]]:
        """(user message, recorded answer) of one turn, the same every time they are asked for."""
        turn = conversation.turns[turn_index]
        rng = random.Random(f"{self.config.seed}/{conversation.conversation_id}/{turn_index}")
        drawn = _tokens(rng, turn.user_len + turn.answer_len, self.config.vocab_size)
        return drawn[: turn.user_len], drawn[turn.user_len :]

    def prompt(self, conversation: Conversation, turn_index: int, history: list[int] | None = None) -> list[int]:
        """Turn `turn_index`'s prompt. history: the conversation before it (system prompt, earlier turns'
        messages and answers), when the caller keeps it; else it is rebuilt."""
        if history is None:
            history = list(self.system_prompts[conversation.system_prompt])
            for index in range(turn_index):
                user, answer = self.turn_tokens(conversation, index)
                history += user + answer
        return history + self.turn_tokens(conversation, turn_index)[0]


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [FIRST_TOKEN_ID + int(rng.random() * (vocab_size - FIRST_TOKEN_ID)) for _ in range(count)]


def generate_trace(config: TraceConfig) -> Trace:
    rng = random.Random(config.seed)
    system_prompts = [_tokens(rng, config.system_prompt_tokens, config.vocab_size)
                      for _ in range(config.num_system_prompts)]
    weights = [1.0 / (i + 1) ** config.system_prompt_zipf for i in range(config.num_system_prompts)]
    conversations, now = [], 0.0
    for conversation_id in range(config.num_conversations):
        now = config.next_arrival(rng, now)
        turns = tuple(
            Turn(rng.randint(*config.user_tokens), rng.randint(*config.answer_tokens),
                 rng.expovariate(1.0 / config.mean_think_s) if config.mean_think_s > 0 else 0.0)
            for _ in range(rng.randint(config.min_turns, config.max_turns)))
        system = rng.choices(range(config.num_system_prompts), weights)[0]
        conversations.append(Conversation(conversation_id, now, system, turns))
    return Trace(config, system_prompts, conversations)
