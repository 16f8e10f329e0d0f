"""The scheduling policies: the order of the waiting queue, and of the running list. Pure Python; no torch.

Both policies keep the running list in the order the step's budget is handed out, with the request to
preempt first at its end:

- fcfs: arrival order. A preempted request goes back to the front of the queue; running requests in the
  order they were admitted, the newest last.
- priority: by rank, lower first, FCFS within a rank. A request's rank is `priority x aging_s + arrival
  time`: each level of priority counts as `aging_s` seconds of later arrival. So a request is passed over
  only by requests that arrive less than (its priority - theirs) x aging_s seconds after it: however busy
  the server, its wait is bounded by what a priority-0 request arriving that much later would wait.
  With aging_s = 0 the order is vLLM's strict (priority, arrival), and a low level can wait forever.
  A waiting request may preempt running requests that rank after it when blocks run out.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagoda.config import SchedulerConfig
from pagoda.engine.core.request import Request


class WaitingQueue(Protocol):
    def push(self, request: Request, front: bool = False) -> None:
        """Queues a request; `front`: it was preempted, or is a deferred sample of an admitted request."""
        ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...

    def __contains__(self, request: object) -> bool: ...

    def add_running(self, running: list[Request], request: Request) -> None:
        """Puts an admitted request in the running list: budget goes front first, preemption takes the last."""
        ...

    def outranks(self, request: Request, running: Request) -> bool:
        """May `request`, waiting for blocks, preempt `running`?"""
        ...


class _Queue:
    """What both queues do alike, over a sequence of requests kept in order (`_queue`)."""

    _queue: deque[Request] | list[Request]

    def peek(self) -> Request:
        return self._queue[0]

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __contains__(self, request: object) -> bool:
        return request in self._queue


class FcfsQueue(_Queue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request, front: bool = False) -> None:
        if front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def add_running(self, running: list[Request], request: Request) -> None:
        running.append(request)

    def outranks(self, request: Request, running: Request) -> bool:
        return False  # FCFS: a waiting request never preempts


class PriorityQueue(_Queue):
    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s
        self._queue: list[Request] = []  # sorted by rank; equal ranks in the order they were queued

    def rank(self, request: Request) -> tuple[float, float]:
        """The sort key: fixed for a request's life, so that a preempted request keeps its place."""
        if self.aging_s > 0:
            return request.priority * self.aging_s + request.arrival_time, 0.0
        return float(request.priority), request.arrival_time

    def push(self, request: Request, front: bool = False) -> None:
        bisect.insort(self._queue, request, key=self.rank)

    def pop(self) -> Request:
        return self._queue.pop(0)

    def add_running(self, running: list[Request], request: Request) -> None:
        bisect.insort(running, request, key=self.rank)

    def outranks(self, request: Request, running: Request) -> bool:
        return self.rank(request) < self.rank(running)


def make_waiting_queue(config: SchedulerConfig) -> FcfsQueue | PriorityQueue:
    if config.scheduling_policy == "priority":
        return PriorityQueue(config.priority_aging_s)
    return FcfsQueue()
