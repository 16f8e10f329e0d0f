"""What one attempt on a replica says about that replica: a bad request is not a bad replica.

A request that fails the same way wherever it goes (a field out of range, a grammar the replica cannot
compile) must not eject replicas: counted against each breaker and retried on the next, a handful of such
requests would take the whole service down. So only what says the replica itself is unwell counts toward its
circuit breaker and is retried elsewhere; what is the request's own fault goes back to the client as it came.

The whole table, with what the client gets: docs/router.md, "Faults".
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from pagoda.wire import ERROR_SCOPE_HEADER, REQUEST_SCOPE


class Outcome(enum.Enum):
    """How an attempt ended, as the router acts on it. The values label pagoda_router_retries_total."""

    ANSWERED = "answered"  # 2xx-4xx but 429: passed back; the replica is well (its failure count is reset)
    # a 5xx, or a 429 (a tenant over its rate limit), marked request-scoped: passed back; says nothing about the
    # replica
    REQUEST_FAULT = "request"
    SATURATED = "429"  # load, not a failure: skipped until its Retry-After, the request tried elsewhere
    REPLICA_ERROR = "5xx"  # any other 5xx (502, 503, 504, an unmarked 500): a failure, tried elsewhere
    CONNECTION = "connection"  # no answer (connect failure, reset): a failure, tried elsewhere
    TIMEOUT = "timeout"  # no answer in time: a failure, tried elsewhere

    @property
    def retried(self) -> bool:
        """Another replica may take the request (while nothing has reached the client)."""
        return self in (Outcome.SATURATED, Outcome.REPLICA_ERROR, Outcome.CONNECTION, Outcome.TIMEOUT)

    @property
    def is_failure(self) -> bool:
        """Counts toward the replica's circuit breaker."""
        return self in (Outcome.REPLICA_ERROR, Outcome.CONNECTION, Outcome.TIMEOUT)

    @property
    def may_eject_last_replica(self) -> bool:
        """Only a replica that does not answer is ejected when no other is up: one that answers, even with
        errors, serves the requests it can, where the router with none up would answer each one 503."""
        return self in (Outcome.CONNECTION, Outcome.TIMEOUT)


def classify_answer(status: int, headers: Mapping[str, str]) -> Outcome:
    """The outcome of an HTTP answer (headers: case-insensitive, as httpx's are)."""
    request_scoped = headers.get(ERROR_SCOPE_HEADER, "").strip().lower() == REQUEST_SCOPE
    if status == 429:
        return Outcome.REQUEST_FAULT if request_scoped else Outcome.SATURATED
    if status < 500:
        return Outcome.ANSWERED
    return Outcome.REQUEST_FAULT if request_scoped else Outcome.REPLICA_ERROR
