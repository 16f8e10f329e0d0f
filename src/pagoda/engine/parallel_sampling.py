"""Parallel sampling (`n`): one user request fans out into n sample Requests and fans back in to one output.

Each sample is a Request of its own to the scheduler (its id `{request_id}#{index}` when n > 1, its seed
derived from the request's), so the scheduler and the runner know nothing of groups. With prefix caching,
the samples after the first wait until the first has its first token, by which time the prompt's blocks
are cached for them to find instead of computing them again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pagoda.engine.api import CompletionOutput, RequestOutput
from pagoda.engine.core.request import Request


class SampleOutput(Protocol):
    """One sample's output so far (output_processor.SequenceText)."""

    @property
    def request(self) -> Request: ...

    @property
    def finished(self) -> bool: ...

    def completion(self) -> CompletionOutput: ...


SampleT = TypeVar("SampleT", bound=SampleOutput)


def sample_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def sample_seed(seed: int, index: int) -> int:
    """Seeds for the n samples of one request: distinct, and reproducible from the user's seed."""
    return seed if index == 0 else random.Random(seed * 1_000_003 + index).getrandbits(63)


@dataclass
class RequestGroup(Generic[SampleT]):
    """All the engine holds for one user request, from add_request until it finishes, is aborted or fails."""

    request_id: str
    prompt: str | None  # as the user gave it, when that was text
    sequences: list[SampleT]  # one per sample (`n`), in sample order; each holds its Request
    # Samples not yet handed to the scheduler (see the module's docstring).
    deferred: list[Request] = field(default_factory=list)
    failure: Exception | None = None

    @property
    def requests(self) -> list[Request]:
        return [sequence.request for sequence in self.sequences]

    @property
    def finished(self) -> bool:
        return all(sequence.finished for sequence in self.sequences)

    def start(self, defer: bool) -> list[Request]:
        """The samples to schedule now; with `defer` (prefix caching on), only the first."""
        requests = self.requests
        if defer and len(requests) > 1:
            requests, self.deferred = requests[:1], requests[1:]
        return requests

    def output(self) -> RequestOutput:
        first = self.sequences[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[sequence.completion() for sequence in self.sequences],
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            queue_time=first.timeline().queue_time,
            prompt_logprobs=[None, *first.prompt_logprobs] if first.needs_prompt_logprobs else None,
            kv_transfer_params=None if first.kv_transfer_params is None else first.kv_transfer_params.as_dict(),
        )

