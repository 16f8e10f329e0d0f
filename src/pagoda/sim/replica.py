"""A simulated replica: the engine's own scheduler and KV manager, stepped in simulated time, with the model's
forward pass replaced by the step-cost model.

The seam is the executor's (engine/executor.py): the engine calls `execute_model(scheduler_output)` once per
step and gets a `ModelRunnerOutput` back. `ScriptedExecutor` answers that call without a model, with one
token for each request the step samples; the step's seconds come from `StepCost`. Everything else is what
LLMEngine.step runs: `Scheduler.schedule` (admission, chunked prefill, prefix hits, preemption) and
`Scheduler.update` (counts, blocks cached, requests finished and their blocks freed), on the scheduler's clock
set to simulated time. A step starts (schedule) at one moment and ends (update) `seconds` later; requests that
arrive meanwhile wait in an inbox for the next step, as the async engine's command queue holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagoda.config import SchedulerConfig
from pagoda.engine.core.hybrid_kv_cache import make_kv_cache_manager
from pagoda.engine.core.request import Request
from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.scheduler import Scheduler, SchedulerOutput
from pagoda.kv_groups import KVCacheGroup
from pagoda.sampling import SamplingParams
from pagoda.sim.step_cost import StepCost, step_shape
from pagoda.sim.trace import FIRST_TOKEN_ID

# Every simulated output token. It is below the trace's token ids, so an answer's KV blocks never match the
# recorded answer the next turn's prompt carries: a real model's answer (almost surely) does not either.
OUTPUT_TOKEN_ID = FIRST_TOKEN_ID - 1


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica's engine settings, as `pagoda serve` takes them."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # The model's KV cache groups (pagoda/kv_groups.py), as the engine chooses them: a block table per group for
    # sliding-window layers. None: one table over every layer (a model without windows).
    kv_groups: tuple[KVCacheGroup, ...] | None = None


@dataclass(frozen=True)
class Progress:
    """What one step gave one request: its new output tokens, whether it finished, and (from its first
    admission) how many prompt tokens the prefix cache served."""

    request_id: str
    new_tokens: int
    finished: bool
    num_cached_tokens: int
    queue_s: float | None = None  # arrival to first scheduled, once it has been


class ReplicaEngine(Protocol):
    """What the fleet steps: a simulated replica, or (in tests) a real engine on the same clock."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def prefix_cache_queries(self) -> int: ...

    @property
    def prefix_cache_hits(self) -> int: ...

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, now: float) -> None:
        """Queues a request for the next step."""
        ...

    def start_step(self, now: float) -> float | None:
        """Schedules and runs a step starting at `now`: when it ends, or None when there is nothing to do."""
        ...

    def finish_step(self, now: float) -> list[Progress]:
        """Ends the step that start_step began."""
        ...


class ScriptedExecutor:
    """The executor's `execute_model`, without a model: OUTPUT_TOKEN_ID for every request the step samples."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids={
            item.request.request_id: [OUTPUT_TOKEN_ID] for item in scheduler_output.scheduled if item.samples})


class SimReplica:
    def __init__(self, config: ReplicaConfig, cost: StepCost) -> None:
        self.config = config
        self.cost = cost
        self.now = 0.0
        groups = config.kv_groups or (KVCacheGroup(None, (0,)),)
        self.kv_cache = make_kv_cache_manager(config.num_blocks, config.block_size, groups,
                                              config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, clock=lambda: self.now)
        self.executor = ScriptedExecutor()
        self.inbox: list[Request] = []
        self._step: tuple[SchedulerOutput, ModelRunnerOutput, float] | None = None
        self.num_steps = 0
        self.busy_s = 0.0  # simulated seconds spent in steps

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + len(self.inbox)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache.usage()

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.prefix_cache_hits

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, now: float) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.inbox.append(Request(request_id, prompt, params, seed=0, arrival_time=now,
                                  max_model_len=self.config.scheduler.max_model_len))

    def start_step(self, now: float) -> float | None:
        self.now = now
        for request in self.inbox:
            self.scheduler.add_request(request)
        self.inbox.clear()
        output = self.scheduler.schedule()
        if output.is_empty:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler has requests but scheduled nothing: one can never fit")
            return None
        seconds = self.cost.seconds(step_shape(output))
        self._step = output, self.executor.execute_model(output), seconds
        return now + seconds

    def finish_step(self, now: float) -> list[Progress]:
        assert self._step is not None, "finish_step without start_step"
        output, runner_output, seconds = self._step
        self._step = None
        self.now = now
        core_outputs = self.scheduler.update(output, runner_output)
        self.scheduler.observe_step(output, seconds)  # what the max_step_ms cap learns from, as in the engine
        self.num_steps += 1
        self.busy_s += seconds
        return [Progress(o.request.request_id, len(o.new_token_ids), o.request.is_finished,
                         o.request.num_cached_tokens, _queue_s(o.request)) for o in core_outputs]


def _queue_s(request: Request) -> float | None:
    scheduled = request.first_scheduled_time
    return None if scheduled is None else scheduled - request.arrival_time
