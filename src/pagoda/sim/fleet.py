"""The fleet: a trace replayed over N replicas behind the real router, in simulated time.

One event loop, no threads and no sleeping: a heap of (time, order, event). A turn arrives, the router
(`pagoda.router.core.Router`, on the loop's clock, with the policy `pagoda route` runs) chooses its replica and
leases it, and the replica takes it into its next step. A replica steps while it has work: each step starts,
and ends `StepCost` seconds later, when its tokens reach the router's lease as a proxy relays a stream (first
output, then each token; finished with the replica's cached-token count, as the proxy reads it from the usage).
The router's poller is simulated too: every `poll_interval_s`, each replica's waiting requests, KV usage and
prefix-cache counters, as /metrics would show them. A conversation's next turn is sent a think time after its
answer ends; a turn no replica can take (every one saturated) is refused, as a 429, and ends its conversation.
With autoscaling (`sim/autoscale.py`), the router lists every slot the fleet may grow to, the autoscaler reads
each poll, and replicas start (cold, a start-up delay later), drain and retire in the same loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.router.config import RouterConfig
from pagoda.router.core import Decision, Lease, NoReplicaAvailable, Router
from pagoda.router.policies import RoutedPrompt
from pagoda.router.replica import PolledStats
from pagoda.sim.autoscale import AutoscaleConfig, Autoscaler, ScaleEvent, ScalingLog, SlotState
from pagoda.sim.replica import Progress, ReplicaConfig, ReplicaEngine, SimReplica
from pagoda.sim.step_cost import StepCost
from pagoda.sim.trace import Trace

TURN, SUBMIT, STEP_END, POLL, STARTED = 0, 1, 2, 3, 4


@dataclass
class TurnRecord:
    """One request of the trace, as the fleet saw it (times in simulated seconds)."""

    conversation: int
    turn: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    replica: int = -1  # -1: refused (every replica saturated)
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float | None = None  # arrival to first scheduled on its replica

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> float | None:
        """Mean gap between output tokens after the first."""
        if self.finish_s is None or self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass
class _InFlight:
    record: TurnRecord
    decision: Decision
    lease: Lease
    prompt: list[int]
    answer: list[int]  # the recorded answer: the next turn's prompt carries it


@dataclass
class FleetRun:
    """What a replay produced: every turn's record, the replicas (their counters; with autoscaling every one
    ever started, in start order), the router (its leases' counts per slot) and the simulated time it took."""

    records: list[TurnRecord]
    replicas: list[ReplicaEngine]
    router: Router
    simulated_s: float
    num_steps: int = 0
    num_polls: int = 0
    replica_requests: list[int] = field(default_factory=list)
    scaling: ScalingLog | None = None


@dataclass(frozen=True)
class Scaling:
    """Autoscaling for a fleet: the policy, and how a new (cold) replica is made."""

    config: AutoscaleConfig
    new_replica: Callable[[], ReplicaEngine]


class Fleet:
    def __init__(self, trace: Trace, replicas: list[ReplicaEngine], replica_config: ReplicaConfig,
                 router_config: RouterConfig, request_overhead_s: float = 0.0, scaling: Scaling | None = None) -> None:
        """replicas: those up at the start. request_overhead_s: how long after the router chose its replica a
        request reaches it (the serving path's time outside engine steps); its TTFT counts from the choice."""
        if trace.config.longest_prompt > replica_config.scheduler.max_model_len:
            raise ValueError(f"the trace's longest conversation ({trace.config.longest_prompt} tokens) does not fit "
                             f"max_model_len {replica_config.scheduler.max_model_len}")
        if replica_config.num_blocks * replica_config.block_size < replica_config.scheduler.max_model_len:
            raise ValueError("a replica's KV pool must hold max_model_len tokens (one full-length sequence)")
        num_slots = len(replicas)
        if scaling is not None:
            num_slots = scaling.config.max_replicas
            if not scaling.config.min_replicas <= len(replicas) <= num_slots:
                raise ValueError(f"the fleet starts with {len(replicas)} replicas, outside the autoscaler's "
                                 f"[{scaling.config.min_replicas}, {num_slots}]")
        self.trace = trace
        self.engines = list(replicas)  # every replica started, in order
        self.slots: list[ReplicaEngine | None] = [*replicas, *[None] * (num_slots - len(replicas))]
        self.states = [SlotState.READY] * len(replicas) + [SlotState.OFF] * (num_slots - len(replicas))
        self.scaling = scaling
        self.autoscaler = None if scaling is None else Autoscaler(scaling.config)
        self.log = None if scaling is None else ScalingLog(scaling.config)
        self._generation = [0] * num_slots  # a slot's start; a start cancelled before it ended is ignored
        self.replica_config = replica_config
        self.request_overhead_s = request_overhead_s
        self.now = 0.0
        self.router = Router([f"sim://replica-{i}" for i in range(num_slots)], router_config,
                             clock=lambda: self.now)
        self._position = {replica: index for index, replica in enumerate(self.router.replicas)}
        self._events: list[tuple[float, int, int, int, int]] = []
        self._order = itertools.count()
        self._busy = [False] * num_slots
        self._histories: dict[int, list[int]] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self.records: list[TurnRecord] = []
        self.num_steps = 0
        self.num_polls = 0

    def _push(self, when: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self._events, (when, next(self._order), kind, a, b))

    def run(self) -> FleetRun:
        for replica, state in zip(self.router.replicas, self.states):
            self.router.set_health(replica, state is SlotState.READY)
        self._poll()
        for index, conversation in enumerate(self.trace.conversations):
            self._push(conversation.start_s, TURN, index, 0)
        handlers: dict[int, Callable[[int, int], None]] = {TURN: self._turn, SUBMIT: self._submit,
                                                           STEP_END: self._step_end}
        self._push(self.router.config.poll_interval_s, POLL, 0)
        pending = len(self.trace.conversations)  # TURN and STEP_END events in the heap: the poller stops with them
        while pending:
            self.now, _, kind, a, b = heapq.heappop(self._events)
            if kind == POLL:
                self._poll()
                if self.autoscaler is not None:
                    self._autoscale(self.autoscaler)
                self._push(self.now + self.router.config.poll_interval_s, POLL, 0)
                continue
            if kind == STARTED:
                self._started(a, b)
                continue
            before = len(self._events)
            handlers[kind](a, b)
            pending += len(self._events) - before - 1
        return FleetRun(self.records, self.engines, self.router, self.now, self.num_steps, self.num_polls,
                        [replica.routed_requests for replica in self.router.replicas], self.log)

    def _engine(self, index: int) -> ReplicaEngine:
        engine = self.slots[index]
        assert engine is not None, f"slot {index} has no replica running"
        return engine

    def _turn(self, conversation_index: int, turn_index: int) -> None:
        conversation = self.trace.conversations[conversation_index]
        history = self._histories.pop(conversation_index, None)
        if history is None:
            history = list(self.trace.system_prompts[conversation.system_prompt])
        user, answer = self.trace.turn_tokens(conversation, turn_index)
        prompt = history + user
        record = TurnRecord(conversation_index, turn_index, self.now, len(prompt), len(answer))
        self.records.append(record)
        try:
            decision = self.router.choose(RoutedPrompt(prompt))
        except NoReplicaAvailable:
            return  # refused: the conversation ends here
        lease = self.router.begin(decision)
        record.replica = self._position[decision.replica]
        request_id = f"s{conversation_index}-t{turn_index}"
        self._in_flight[request_id] = _InFlight(record, decision, lease, prompt, answer)
        if self.request_overhead_s > 0:
            self._push(self.now + self.request_overhead_s, SUBMIT, conversation_index, turn_index)
        else:
            self._submit(conversation_index, turn_index)

    def _submit(self, conversation_index: int, turn_index: int) -> None:
        request_id = f"s{conversation_index}-t{turn_index}"
        flight = self._in_flight[request_id]
        index = flight.record.replica
        self._engine(index).submit(request_id, flight.prompt, len(flight.answer), self.now)
        if not self._busy[index]:
            self._start_step(index)

    def _start_step(self, index: int) -> None:
        ends = self._engine(index).start_step(self.now)
        self._busy[index] = ends is not None
        if ends is not None:
            self._push(ends, STEP_END, index)

    def _step_end(self, index: int, _unused: int) -> None:
        self.num_steps += 1
        for progress in self._engine(index).finish_step(self.now):
            self._progress(progress)
        self._start_step(index)
        self._retire_if_drained(index)

    def _progress(self, progress: Progress) -> None:
        flight = self._in_flight[progress.request_id]
        record, lease = flight.record, flight.lease
        if progress.new_tokens:
            if record.first_token_s is None:
                record.first_token_s, record.queue_s = self.now, progress.queue_s
                lease.first_output()
            lease.add_output_tokens(progress.new_tokens)
            record.output_tokens += progress.new_tokens
        if not progress.finished:
            return
        del self._in_flight[progress.request_id]
        record.finish_s = self.now
        record.cached_tokens = progress.num_cached_tokens
        self.router.observe_cached_tokens(flight.decision, progress.num_cached_tokens)
        self.router.record_success(flight.decision.replica)
        lease.finish(succeeded=True)
        conversation = self.trace.conversations[record.conversation]
        if record.turn + 1 < len(conversation.turns):
            self._histories[record.conversation] = flight.prompt + flight.answer
            self._push(self.now + conversation.turns[record.turn].think_s, TURN, record.conversation, record.turn + 1)

    def _poll(self) -> None:
        """What the router's poller reads from each replica's /metrics."""
        self.num_polls += 1
        config = self.replica_config
        for replica, engine, state in zip(self.router.replicas, self.slots, self.states):
            if engine is None:
                continue
            self.router.update_stats(replica, PolledStats(
                num_waiting=engine.num_waiting, kv_usage=engine.kv_usage, block_size=config.block_size,
                num_blocks=config.num_blocks, prefix_cache_queries=engine.prefix_cache_queries))
            if state is SlotState.READY and not replica.healthy:  # its health check answers now
                self.router.set_health(replica, True)

    # --- autoscaling --------------------------------------------------------------------------------

    def _autoscale(self, autoscaler: Autoscaler) -> None:
        assert self.scaling is not None and self.log is not None
        gauge = "num_waiting" if self.scaling.config.metric == "num_requests_waiting" else "kv_usage"
        autoscaler.observe(self.now, [getattr(replica.stats, gauge) for replica, state in
                                      zip(self.router.replicas, self.states)
                                      if state is SlotState.READY and replica.healthy])
        provisioned = self._count(SlotState.STARTING, SlotState.READY)
        wanted = autoscaler.decide(self.now, provisioned)
        if wanted > provisioned:
            for index in [i for i, state in enumerate(self.states) if state is SlotState.OFF][: wanted - provisioned]:
                self.states[index] = SlotState.STARTING
                self._generation[index] += 1
                self._push(self.now + self.scaling.config.startup_delay_s, STARTED, index, self._generation[index])
                self.log.events.append(ScaleEvent(self.now, index, "start"))
        elif wanted < provisioned:  # replicas still starting go first, then the highest ordinals
            order = sorted(range(len(self.states)), key=lambda i: (self.states[i] is not SlotState.STARTING, -i))
            for index in [i for i in order if self.states[i] in (SlotState.STARTING, SlotState.READY)][
                    : provisioned - wanted]:
                self._stop(index)
        ready, starting = self._count(SlotState.READY), self._count(SlotState.STARTING)
        self.log.timeline.append({
            "t_s": self.now, "ready": ready, "starting": starting, "draining": self._count(SlotState.DRAINING),
            "provisioned": ready + starting, "metric": autoscaler.windowed, "wanted": wanted})

    def _count(self, *states: SlotState) -> int:
        return sum(1 for state in self.states if state in states)

    def _started(self, index: int, generation: int) -> None:
        """A start-up delay after it was asked for: a new replica, its prefix cache empty."""
        assert self.scaling is not None and self.log is not None
        if self._generation[index] != generation or self.states[index] is not SlotState.STARTING:
            return  # cancelled while starting
        engine = self.scaling.new_replica()
        self.slots[index] = engine
        self.engines.append(engine)
        self.states[index] = SlotState.READY
        self.log.events.append(ScaleEvent(self.now, index, "ready"))

    def _stop(self, index: int) -> None:
        assert self.log is not None
        if self.states[index] is SlotState.STARTING:
            self.states[index] = SlotState.OFF
            self.log.events.append(ScaleEvent(self.now, index, "cancel"))
            return
        replica = self.router.replicas[index]
        self.states[index] = SlotState.DRAINING
        self.router.set_health(replica, False)  # its health check fails: the router sends it nothing more
        self.log.events.append(ScaleEvent(self.now, index, "drain", replica.active_requests))
        self._retire_if_drained(index)

    def _retire_if_drained(self, index: int) -> None:
        if self.states[index] is not SlotState.DRAINING or self._busy[index]:
            return
        if self.router.replicas[index].active_requests:  # leased: in its engine, or on its way there
            return
        assert self.log is not None
        self.states[index] = SlotState.OFF
        self.slots[index] = None
        self.log.events.append(ScaleEvent(self.now, index, "retire"))



def simulate(trace: Trace, num_replicas: int, replica_config: ReplicaConfig, router_config: RouterConfig,
             cost: StepCost, autoscale: AutoscaleConfig | None = None) -> FleetRun:
    """The trace over `num_replicas` simulated replicas behind the router (with autoscale: at the start)."""
    replicas: list[ReplicaEngine] = [SimReplica(replica_config, cost) for _ in range(num_replicas)]
    scaling = None if autoscale is None else Scaling(autoscale, lambda: SimReplica(replica_config, cost))
    return Fleet(trace, replicas, replica_config, router_config, cost.request_overhead_s, scaling).run()
