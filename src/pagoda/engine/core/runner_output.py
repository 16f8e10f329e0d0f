"""What one step of the model runner gives back to the scheduler: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

# A chunk of one request's prompt logprobs: (index of the first prompt position covered, logprobs of the
# prompt tokens that follow each covered position).
PromptLogprobsChunk = tuple[int, list[dict[int, float]]]


@dataclass
class ModelRunnerOutput:
    # request id -> the tokens the step yields, in order: the one sampled; for a speculating request, the
    # drafts it accepted and the target's own token after them (accepted + bonus). The scheduler appends
    # them as they are, up to a stop: the runner alone decides which drafts are kept.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> for each of its sampled_token_ids, {chosen id: lp, top ids: lp}, when asked
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)  # by request id
    # request id -> why it failed this step (it has no sampled_token_ids): the engine fails it alone
    failures: dict[str, Exception] = field(default_factory=dict)
    # request id -> how many of its tokens have valid KV, for a request whose KV load failed this step (the KV
    # connector's): it did not run, and computes the tokens past that instead.
    kv_load_failures: dict[str, int] = field(default_factory=dict)
    # request id -> the pooled vector of an embedding request whose prompt this step completed
    pooled: dict[str, list[float]] = field(default_factory=dict)
