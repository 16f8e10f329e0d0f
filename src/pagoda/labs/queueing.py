"""Lab: where is the knee, and how well does M/M/1 predict the queue before it?

The knob is the arrival rate, as a share rho of what the engine can serve. The engine is one server: one slot
(`max_num_seqs=1`), so requests are served one at a time, and a request of L output tokens holds it for L
steps. Time is counted in engine steps, so the run depends on counts alone: requests arrive open-loop, as a
Poisson process in steps (they come whether or not the engine keeps up), with output lengths drawn from a
geometric distribution of mean m (exponential-like service), and the run drains after the last arrival. The
prediction is M/M/1's with mu = 1/m per step: mean time in system m / (1 - rho), mean queue rho^2 / (1 - rho),
and the share done within an SLO, 1 - exp(-(mu - lambda) x SLO). Counted: each request's steps from arrival
to its last token, and the requests waiting at each step. Little's law (mean number in system = arrival rate
x mean time in system) holds on the counts exactly; the wall time per step is reported, not checked.
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING

from pagoda.calc import formulas
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from pagoda import LLM

NAME = "queueing"
QUESTION = "Where is the knee, and how well does M/M/1 predict the queue before it?"
PROMPT_TOKENS = 8
SLO_SERVICE_TIMES = 4  # the SLO: done within this many mean service times of arriving


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM

    loads, mean_len, horizon = ((0.3, 0.6, 0.9), 8, 800) if quick else ((0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95), 16, 8000)
    rows: list[dict[str, Cell]] = []
    for rho in loads:
        llm = LLM(model, max_num_seqs=1, max_step_ms=0, enable_prefix_caching=False)
        arrival_rate, service_rate = rho / mean_len, 1 / mean_len
        measured = _run_open_loop(llm, arrival_rate, mean_len, horizon, random.Random(0))
        del llm
        slo = SLO_SERVICE_TIMES * mean_len
        rows.append({
            "rho": rho, "drawn_rho": measured["drawn_rho"], "requests": measured["requests"],
            "predicted_sojourn": formulas.mm1_mean_sojourn(arrival_rate, service_rate),
            "sojourn": measured["sojourn"],
            "predicted_queue": formulas.mm1_mean_queue(arrival_rate, service_rate), "queue": measured["queue"],
            "predicted_within_slo": formulas.mm1_within(arrival_rate, service_rate, slo),
            "within_slo": measured["within_slo"], "littles_law": measured["littles_law"],
            "busy_while_waiting": measured["busy_while_waiting"], "step_ms": measured["step_ms"],
        })
    queues = [_number(row["queue"]) for row in rows]
    holds = (all(row["littles_law"] and row["busy_while_waiting"] for row in rows)
             and queues == sorted(queues) and queues[-1] > 4 * queues[len(queues) // 2])
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("rho", "load rho"), ("drawn_rho", "rho drawn"), ("requests", "requests"),
                 ("predicted_sojourn", "steps in system: M/M/1"),
                 ("sojourn", "steps in system: real"), ("predicted_queue", "queue: M/M/1"), ("queue", "queue: real"),
                 ("predicted_within_slo", f"within {SLO_SERVICE_TIMES}m: M/M/1"), ("within_slo", "within SLO: real"),
                 ("littles_law", "Little's law"), ("step_ms", "ms per step")],
        rows=rows,
        lesson=("The queue stays short until the load nears what the server can do, then grows as 1 / (1 - rho): "
                "the knee. M/M/1 predicts where it bends; the counts differ where service is not quite exponential "
                "and a finite run has not reached steady state (the nearer the knee, the longer that takes). "
                "Little's law holds exactly on any run, knee or not."),
        lesson_holds=holds,
        settings={"model": model, "mean_output_tokens": mean_len, "arrival_horizon_steps": horizon,
                  "prompt_tokens": PROMPT_TOKENS, "max_num_seqs": 1, "slo_steps": SLO_SERVICE_TIMES * mean_len,
                  "quick": quick},
    )


def _run_open_loop(llm: LLM, arrival_rate: float, mean_len: int, horizon: int, rng: random.Random) -> dict[str, Cell]:
    from pagoda import SamplingParams

    engine, vocab = llm.engine, len(llm.get_tokenizer())
    arrivals: list[tuple[int, int]] = []  # (step it arrives at, output tokens)
    moment = rng.expovariate(arrival_rate)
    while moment < horizon:
        length = min(1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / mean_len)), 4 * 16 * mean_len)
        arrivals.append((int(moment), length))
        moment += rng.expovariate(arrival_rate)
    arrived_at: dict[str, int] = {}
    sojourns: list[int] = []
    in_system = waiting = busy_while_waiting = 0
    step, next_arrival, seconds = 0, 0, 0.0
    while next_arrival < len(arrivals) or engine.has_unfinished_requests():
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= step:
            request_id = f"lab-queue-{next_arrival}"
            prompt = [rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)]
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=arrivals[next_arrival][1],
                                                                  ignore_eos=True))
            arrived_at[request_id] = step
            next_arrival += 1
        stats = engine.stats()
        in_system += stats.num_running + stats.num_waiting
        waiting += stats.num_waiting
        started = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - started
        busy_while_waiting += bool(outputs) or not stats.num_waiting  # the server never idles with a queue
        sojourns += [step - arrived_at[o.request_id] + 1 for o in outputs if o.finished]
        step += 1
    slo = SLO_SERVICE_TIMES * mean_len
    return {
        "requests": len(sojourns), "drawn_rho": sum(length for _, length in arrivals) / horizon,
        "sojourn": sum(sojourns) / len(sojourns), "queue": waiting / step,
        "within_slo": sum(s <= slo for s in sojourns) / len(sojourns),
        # Each request is in the system at every step from its arrival to its last token: the sums are equal.
        "littles_law": in_system == sum(sojourns),
        "busy_while_waiting": busy_while_waiting == step, "step_ms": 1e3 * seconds / step,
    }


def _number(value: Cell) -> float:
    assert isinstance(value, (int, float))
    return float(value)


def plot(result: LabResult, axes: Axes) -> None:
    rhos = result.column("rho")
    curve = [i / 100 for i in range(5, 97)]
    mean_len = result.settings["mean_output_tokens"]
    axes.plot(curve, [mean_len / (1 - rho) for rho in curve], "-", label="M/M/1: m / (1 - rho)")
    axes.plot(rhos, result.column("sojourn"), "o", label="engine: mean steps in system")
    axes.set_xlabel("load rho (arrival rate / service rate)")
    axes.set_ylabel("steps from arrival to last token")
    axes.set_yscale("log")
    axes.legend(loc="upper left")
