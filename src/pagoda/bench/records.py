"""What the client saw of one request: timestamps, token counts, error. Metrics are computed from these.

Times are seconds on one monotonic clock (`time.monotonic`). `scheduled` and `sent` are measured from the
start of the run; everything else (`chunk_times`, `end`) from `sent`, so a record reads as a timeline of
its own request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    request_id: str
    conversation: int = 0
    turn: int = 0
    scheduled: float | None = None  # open loop: when the schedule said to send it (None: closed loop)
    sent: float = 0.0  # when the client started sending it
    chunk_times: list[float] = field(default_factory=list)  # after `sent`: each chunk that carried content
    end: float | None = None  # after `sent`: when the response was over (stream closed, [DONE])
    max_tokens: int = 0  # output tokens asked for
    priority: int | None = None  # vLLM's request priority, when the workload sends one (lower runs first)
    tenant: str | None = None  # whose request it is, when the workload names tenants (sent as a header or API key)
    prompt_tokens: int | None = None  # server's usage.prompt_tokens
    output_tokens: int | None = None  # server's usage.completion_tokens
    cached_tokens: int | None = None  # server's usage.prompt_tokens_details.cached_tokens (prefix cache hits)
    expected_prompt_tokens: int | None = None  # the client's own count of the prompt (exact for token ids)
    client_output_tokens: int | None = None  # the client tokenizer's count of the output text
    output_chars: int = 0
    finish_reason: str | None = None
    error: str | None = None  # error type ("http_429", "timeout", "stream_error", ...); None when it succeeded
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Time to first token: from sending to the first chunk that carried content."""
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.end

    @property
    def num_output_tokens(self) -> int | None:
        """The server's count when it gave one (usage), else the client tokenizer's."""
        return self.output_tokens if self.output_tokens is not None else self.client_output_tokens

    @property
    def send_delay(self) -> float | None:
        """Open loop: how long after its scheduled time it went out (client lag, plus waiting for a slot
        under a concurrency cap)."""
        return None if self.scheduled is None else self.sent - self.scheduled

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        return record

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{key: value for key, value in data.items() if key in cls.__dataclass_fields__})
