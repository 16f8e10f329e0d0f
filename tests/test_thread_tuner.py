"""The step's thread count follows the cores free: fewer threads while a neighbour is busy, all of them again
once it leaves, few probes on an idle machine, and output unchanged however often the count changes."""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.engine.thread_tuner import ThreadCountTuner, TunerSettings


class Machine:
    """Steps on `cores` cores, `busy` of them shared with a spinning neighbour: a step of `work` seconds on one
    idle core, split evenly over the threads, waits for its slowest thread; a thread on a shared core gets a
    third of it (the barrier's cost, as measured on two cores)."""

    def __init__(self, cores: int, work: float = 0.02) -> None:
        self.cores, self.work, self.busy = cores, work, 0
        self.now = 0.0
        self.threads_run: list[int] = []

    def step_time(self, threads: int) -> float:
        on_free = min(threads, self.cores - self.busy)
        slowest = 1.0 if threads == on_free else 3.0
        # Fewer than all cores read memory less in parallel: a lone thread keeps ~70% of two threads' speed.
        parallel = threads ** 0.5 * 1.2 if threads > 1 else 1.0
        return self.work / parallel * slowest

    def run(self, tuner: ThreadCountTuner, seconds: float, shape: object = "decode") -> None:
        end = self.now + seconds
        while self.now < end:
            threads = tuner.running
            self.threads_run.append(threads)
            took = self.step_time(threads)
            self.now += took
            tuner.observe(shape, took)


def tuner_on(machine: Machine, threads: int, **settings: float) -> tuple[ThreadCountTuner, list[int]]:
    calls: list[int] = []
    tuner = ThreadCountTuner(threads, calls.append, TunerSettings(**settings), clock=lambda: machine.now)
    return tuner, calls


def test_idle_machine_keeps_every_thread_and_probes_rarely() -> None:
    machine = Machine(cores=2)
    tuner, _ = tuner_on(machine, 2)
    machine.run(tuner, 60.0)
    assert tuner.threads == 2 and tuner.switches == 0
    probed = sum(1 for threads in machine.threads_run if threads == 1) / len(machine.threads_run)
    assert 0 < probed < 0.01  # 3 steps every 4 s once the interval has backed off


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back() -> None:
    machine = Machine(cores=2)
    tuner, calls = tuner_on(machine, 2)
    machine.run(tuner, 10.0)
    machine.busy = 1
    arrived = len(machine.threads_run)
    machine.run(tuner, 1.0)
    assert tuner.threads == 1  # the slowdown starts a probe at once: no waiting out the backed-off interval
    assert machine.threads_run[arrived:].count(2) <= 2 * tuner.settings.samples + 1
    machine.run(tuner, 10.0)
    assert tuner.threads == 1
    machine.busy = 0
    machine.run(tuner, tuner.settings.max_probe_interval_s + 1.0)
    assert tuner.threads == 2 and tuner.switches == 2
    assert calls[-1] == 2


def test_climbs_down_one_thread_at_a_time_to_the_free_cores() -> None:
    machine = Machine(cores=4)
    tuner, _ = tuner_on(machine, 4)
    machine.busy = 2
    machine.run(tuner, 10.0)
    assert tuner.threads == 2


def test_steps_of_different_shapes_are_never_compared() -> None:
    machine = Machine(cores=2)
    machine.busy = 1  # a probe that completed would switch to one thread
    tuner, calls = tuner_on(machine, 2, probe_interval_s=0.0, probe_budget=1.0)
    for index in range(401):
        shape = (index // 4) % 2  # the batch changes every four steps: a probe never gets its three
        took = machine.step_time(tuner.running)
        machine.now += took
        tuner.observe(shape, took)
    assert tuner.threads == 2 and tuner.switches == 0
    assert calls and calls[-1] == 2  # each cut-off probe put the count back


def test_probes_spend_at_most_their_budget_of_the_steps_time() -> None:
    """Long steps whose shape changes every few steps (a loaded server): probes start and are cut off, and
    each costs a slow step; the budget bounds what they take together."""
    machine = Machine(cores=2, work=0.4)
    tuner, _ = tuner_on(machine, 2)
    spent = total = 0.0
    for index in range(2000):
        threads = tuner.running
        took = machine.step_time(threads)
        machine.now += took
        total += took
        spent += took if threads == 1 else 0.0
        tuner.observe((index // 5) % 3, took)
    assert tuner.threads == 2
    assert 0 < spent <= tuner.settings.probe_budget * total + machine.step_time(1)


def test_noise_alone_never_takes_a_thread_away() -> None:
    """Steps 20% apart at random, the same at either count: a step down needs fewer threads 25% faster."""
    import random

    random.seed(1)
    clock = [0.0]
    tuner = ThreadCountTuner(2, lambda threads: None, clock=lambda: clock[0])
    for _ in range(20000):
        took = 0.01 * random.uniform(0.9, 1.1)
        clock[0] += took
        tuner.observe("decode", took)
    assert tuner.switches == 0


def test_a_single_thread_has_nothing_to_adapt() -> None:
    with pytest.raises(ValueError, match="max_threads >= 2"):
        ThreadCountTuner(1, lambda threads: None)


def test_greedy_output_is_unchanged_when_the_count_changes_every_few_steps(checkpoint, make_llm) -> None:
    model_dir = checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fixed = make_llm(model_dir, cpu_threads_adapt=False)
        assert fixed.engine.executor.thread_tuner is None
        expected = [out.outputs[0].token_ids for out in fixed.generate(prompts, params)]
        adapting = make_llm(model_dir)
        # Every probe kept (a margin of -100%) and no pause between probes: the count flips every 3 steps.
        always = TunerSettings(probe_interval_s=0.0, probe_budget=1.0, margin_down=-1.0, margin_up=-1.0,
                               give_up=float("inf"))
        tuner = ThreadCountTuner(2, torch.set_num_threads, always)
        adapting.engine.executor.thread_tuner = tuner
        actual = [out.outputs[0].token_ids for out in adapting.generate(prompts, params)]
    finally:
        torch.set_num_threads(threads)
    assert tuner.switches >= 3
    assert actual == expected
    from pagoda.server.metrics import ServerMetrics

    text = ServerMetrics("m", adapting.engine.stats).render().decode()
    assert f'pagoda:step_threads{{model_name="m"}} {float(tuner.threads)}' in text
    assert f'pagoda:step_thread_changes_total{{model_name="m"}} {float(tuner.switches)}' in text
    assert 'pagoda:step_threads{model_name="m"} 2.0' in ServerMetrics("m", fixed.engine.stats).render().decode()
