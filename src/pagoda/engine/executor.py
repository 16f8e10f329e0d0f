"""The executor: what runs the model for the engine, in one process or across several.

The engine core calls `execute_model(scheduler_output)` once per step and gets the runner's output back; it
never knows how many processes hold the model. `UniProcExecutor` runs it in the engine's own process;
`MultiprocExecutor` (engine/multiproc_executor.py) splits it across ranks (tensor-parallel, in pipeline stages).
Either way rank 0's `ModelRunner` (in the engine's process) samples, checks drafts and fills grammar masks.
"""

from __future__ import annotations

import time

from pagoda.engine.core.runner_output import ModelRunnerOutput
from pagoda.engine.core.scheduler import SchedulerOutput
from pagoda.engine.model_step import RankReport, rank_report
from pagoda.engine.runner import ModelRunner
from pagoda.engine.thread_tuner import ThreadCountTuner


class Executor:
    """Runs each scheduled step through rank 0's runner (and, in subclasses, the other ranks beside it)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    @property
    def pipeline_parallel_size(self) -> int:
        return 1

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def rank_reports(self) -> list[RankReport]:
        """What each rank holds (its weights' bytes, its KV cache's: its layers' and KV heads') and whether it decodes
        through the native stack, in rank order."""
        return [rank_report(self.runner.model, self.runner.kv_caches)]

    def weight_bytes_per_rank(self) -> list[int]:
        return [report.weight_bytes for report in self.rank_reports()]

    def kv_bytes_per_rank(self) -> list[int]:
        return [report.kv_bytes for report in self.rank_reports()]

    def step_threads(self) -> tuple[int, int] | None:
        """(the threads rank 0's steps run with now, how often that changed) where they adapt; None: as started."""
        return None

    def check_health(self) -> None:
        """Raises EngineDeadError when the executor can run no step any more (a rank has gone)."""

    def shutdown(self) -> None:
        """Stops whatever the executor started (idempotent)."""


class UniProcExecutor(Executor):
    """The whole model in the engine's own process; with a thread tuner, each step runs with the thread count
    it chooses from the steps before (engine/thread_tuner.py)."""

    def __init__(self, runner: ModelRunner, thread_tuner: ThreadCountTuner | None = None) -> None:
        super().__init__(runner)
        self.thread_tuner = thread_tuner

    def step_threads(self) -> tuple[int, int] | None:
        tuner = self.thread_tuner
        return None if tuner is None else (tuner.threads, tuner.switches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.thread_tuner is None:
            return self.runner.execute_model(scheduler_output)
        started = time.perf_counter()
        output = self.runner.execute_model(scheduler_output)
        shape = (len(scheduler_output.scheduled), scheduler_output.num_batched_tokens)
        self.thread_tuner.observe(shape, time.perf_counter() - started)
        return output
