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

Across tenants, the waiting queue is fair (`FairQueue`): each tenant's requests wait in the policy's order in a
queue of their own, and the next admitted is the head of the tenant that has been given the fewest tokens for its
weight (a virtual token counter, as in Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
Requests of no tenant are one tenant of weight 1, so with a single tenant the order is the policy's alone.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from pagoda.config import SchedulerConfig
from pagoda.engine.core.request import Request


class WaitingQueue(Protocol):
    def push(self, request: Request, front: bool = False) -> None:
        """Queues a request; `front`: it was preempted, or is a deferred sample of an admitted request."""
        ...

    def peek(self) -> Request: ...

    def take(self, request: Request) -> None:
        """Removes `request`, the head of its tenant's queue (`peek`, or `place_for`'s pick), as it is admitted."""
        ...

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

    def place_for(self, running: list[Request]) -> tuple[Request, Request] | None:
        """With the running batch full: a waiting request that takes a place, and the running request it takes
        it from (to be preempted); or None: the queue waits for a place to free."""
        ...

    def charge(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        """Counts the tokens a step gave each request (fairness among tenants)."""
        ...

    def order_running(self, running: list[Request]) -> None:
        """Reorders the running list, in place, as a step starts (tenants over their KV quota last)."""
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


PolicyQueue = FcfsQueue | PriorityQueue


class FairQueue:
    """The policy's queue per tenant, served by lowest counter: a tenant's counter is the tokens its requests have
    been given (prefill chunks, decodes, drafts) over its weight. A tenant that comes back with nothing waiting
    starts no lower than the lowest counter of the tenants that have requests waiting (or, with none, of the last
    one served), so time away banks no credit. Running requests keep the policy's order, across tenants too, and
    so does preemption, but that a tenant over its KV quota goes last (`order_running`)."""

    def __init__(self, make_policy_queue: Callable[[], PolicyQueue]) -> None:
        self._make = make_policy_queue
        self._policy = make_policy_queue()  # its ordering of running requests: it holds none itself
        self._queues: dict[str | None, PolicyQueue] = {}
        self.counters: dict[str | None, float] = {}
        self._last_served = 0.0
        self._admission: dict[str, int] = {}  # request id -> when it was admitted: the fcfs order of the running
        self._num_admitted = 0
        self._reordered = False  # the running list is out of the policy's order (a tenant was over its quota)

    @staticmethod
    def _tenant(request: Request) -> str | None:
        return request.tenant.name if request.tenant is not None else None

    def push(self, request: Request, front: bool = False) -> None:
        tenant = self._tenant(request)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = self._make()
        if not queue:
            waiting = [self.counters[t] for t, q in self._queues.items() if q and t != tenant]
            floor = min(waiting) if waiting else self._last_served
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        queue.push(request, front)

    def _next_queue(self) -> PolicyQueue:
        """The queue of the waiting tenant with the lowest counter; ties go to the earlier head."""
        tenant = min((t for t, q in self._queues.items() if q),
                     key=lambda t: (self.counters[t], self._queues[t].peek().arrival_time))
        return self._queues[tenant]

    def peek(self) -> Request:
        return self._next_queue().peek()

    def take(self, request: Request) -> None:
        tenant = self._tenant(request)
        popped = self._queues[tenant].pop()
        assert popped is request, "only the head of a tenant's queue is admitted"
        self._last_served = self.counters[tenant]

    def remove(self, request: Request) -> None:
        self._queues[self._tenant(request)].remove(request)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(self._queues.values())

    def __contains__(self, request: object) -> bool:
        queue = self._queues.get(self._tenant(request)) if isinstance(request, Request) else None
        return queue is not None and request in queue

    def add_running(self, running: list[Request], request: Request) -> None:
        self._num_admitted += 1
        self._admission[request.request_id] = self._num_admitted
        self._policy.add_running(running, request)

    def order_running(self, running: list[Request]) -> None:
        """Puts the requests of tenants holding more KV blocks than their quota (`max_kv_blocks`) last, in the
        policy's order among themselves: the step's budget reaches them last and preemption takes them first. Once
        no tenant is over, the policy's order comes back."""
        if len(self._admission) > 2 * len(running) + 64:  # forget the requests that left, now and then
            self._admission = {r.request_id: self._admission.get(r.request_id, 0) for r in running}
        quota = {r.tenant.name: r.tenant.max_kv_blocks for r in running
                 if r.tenant is not None and r.tenant.max_kv_blocks is not None}
        over = {name for name, blocks in blocks_held_by_tenant(running).items()
                if name in quota and blocks > quota[name]}
        if not over and not self._reordered:
            return
        self._admission = {r.request_id: self._admission.get(r.request_id, 0) for r in running}
        policy = self._policy
        rank = policy.rank if isinstance(policy, PriorityQueue) else lambda _request: (0.0, 0.0)
        running.sort(key=lambda r: (r.tenant is not None and r.tenant.name in over, rank(r),
                                    self._admission[r.request_id]))
        self._reordered = bool(over)

    def outranks(self, request: Request, running: Request) -> bool:
        return self._policy.outranks(request, running)

    def place_for(self, running: list[Request]) -> tuple[Request, Request] | None:
        """Each tenant running or waiting has a weighted share of the full batch's places. The waiting tenants are
        asked in counter order, and the first holding fewer places than its share takes one from the tenant
        furthest over its own: that tenant's last running request in the policy's order is preempted (it keeps its
        cached blocks), and the place goes to the taker's head. So a tenant whose burst filled the batch while the
        others were away gives places back as they come, none is taken from a tenant within its share, and a
        tenant at its share, waiting for a place to free, does not hold up another below its own."""
        held = Counter(self._tenant(r) for r in running)
        weight = {self._tenant(r): r.tenant.weight if r.tenant is not None else 1.0
                  for r in itertools.chain(running, (q.peek() for q in self._queues.values() if q))}
        total = sum(weight.values())
        share = {tenant: w / total * len(running) for tenant, w in weight.items()}
        over = [t for t in held if held[t] > share[t]]
        waiting = sorted((t for t, q in self._queues.items() if q),
                         key=lambda t: (self.counters[t], self._queues[t].peek().arrival_time))
        for tenant in waiting:
            donors = [t for t in over if t != tenant]
            if held[tenant] + 1 <= share[tenant] and donors:
                donor = max(donors, key=lambda t: held[t] / weight[t])
                return self._queues[tenant].peek(), next(r for r in reversed(running) if self._tenant(r) == donor)
        return None

    def charge(self, scheduled: Iterable[tuple[Request, int]]) -> None:
        for request, num_tokens in scheduled:
            tenant = self._tenant(request)
            weight = request.tenant.weight if request.tenant is not None else 1.0
            self.counters[tenant] = self.counters.get(tenant, 0.0) + num_tokens / weight


def blocks_held_by_tenant(running: Iterable[Request]) -> dict[str, int]:
    """The KV blocks each tenant's running requests hold, as its quota counts them: every KV cache group's pool
    blocks (not the places a sliding window dropped), and a block shared by two of its requests (a common prefix)
    counts for each."""
    held: dict[str, int] = {}
    for request in running:
        if request.tenant is not None:
            held[request.tenant.name] = held.get(request.tenant.name, 0) + request.num_blocks_held
    return held


def make_waiting_queue(config: SchedulerConfig) -> FairQueue:
    if config.scheduling_policy == "priority":
        return FairQueue(lambda: PriorityQueue(config.priority_aging_s))
    return FairQueue(FcfsQueue)
