"""The waiting-queue bound: how many sequences may wait for the engine, counted and reserved at the door."""

from __future__ import annotations

from pagoda.wire import OpenAIError


class Admission:
    """The waiting-queue bound (`--max-waiting-requests`, counted in sequences: prompts x n), on the event
    loop only.

    A sequence admitted at the door counts as waiting until its prompt has produced its first output. A
    request is admitted whole or not at all, and its slots are reserved synchronously when it is admitted,
    so neither one large request nor a burst can take the queue past the bound.
    """

    def __init__(self, max_waiting: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.num_waiting = 0

    def admit(self, num_prompts: int, n: int) -> WaitingSlots:
        """Reserves num_prompts x n slots, or raises OpenAIError: 429 (with Retry-After) when they do not fit
        now, 400 when they never can."""
        wanted = num_prompts * n
        if self.max_waiting is not None and wanted > self.max_waiting:
            param = "n" if n > 1 else "prompt"
            raise OpenAIError(400, f"the request asks for {wanted} sequences (prompts x n); the server queues at "
                                   f"most {self.max_waiting}", param)
        if self.max_waiting is not None and self.num_waiting + wanted > self.max_waiting:
            raise OpenAIError(429, "the server is at its waiting-queue bound; retry later",
                              headers={"Retry-After": "1"})
        return WaitingSlots(self, num_prompts, n)

    def reserve(self, count: int) -> None:
        self.num_waiting += count

    def release(self, count: int) -> None:
        self.num_waiting -= count


class WaitingSlots:
    """One request's reservation: n slots per prompt, each prompt's given back once."""

    def __init__(self, admission: Admission, num_prompts: int, n: int) -> None:
        self.admission, self.n = admission, n
        self.held = set(range(num_prompts))
        admission.reserve(num_prompts * n)

    def release(self, prompt_index: int | None = None) -> None:
        """Gives back one prompt's slots, or (None) all that are still held."""
        for index in list(self.held) if prompt_index is None else [prompt_index]:
            if index in self.held:
                self.held.discard(index)
                self.admission.release(self.n)
