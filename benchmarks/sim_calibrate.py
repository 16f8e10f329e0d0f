"""Calibrates `pagoda sim`'s step-cost model on this machine: a real in-process engine runs prefill-only,
decode-only and mixed steps, every LLMEngine.step() is timed whole (schedule, forward, update, outputs: what a
stream waits for), each step's shape is read from what the scheduler gave it, and StepCost.fit writes the
coefficients as JSON for `pagoda sim --step-cost`.

    python benchmarks/sim_calibrate.py --model models/bench-125m --threads 1 --out step_cost.json

--quick runs a few steps of each kind (a check that the script works, not a calibration).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY / "src"))

from pagoda.sim.step_cost import StepCost, StepShape, step_shape  # noqa: E402


def measure(engine, prompts: list[list[int]], max_tokens: int, samples: list[tuple[StepShape, float]]) -> None:
    """Adds the prompts (greedy, ignore_eos), steps to completion and appends each step's (shape, seconds)."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(f"calibrate-{time.monotonic_ns()}", prompt, params)
    shapes: list[StepShape] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        shapes.append(step_shape(output))
        return output

    engine.scheduler.schedule = recording_schedule
    try:
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            samples.append((shapes.pop(), time.perf_counter() - started))
    finally:
        del engine.scheduler.schedule


def calibrate(model: str, threads: int, quick: bool, dtype: str, max_model_len: int) -> StepCost:
    import torch

    from pagoda import LLM

    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=max_model_len,
              num_kv_blocks=32 * max_model_len // 16 + 16, enable_prefix_caching=False, max_step_ms=0)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(count)]

    longest = max_model_len - 64
    lengths = [16, 64, longest // 2, longest] if not quick else [16, 64]
    batches = [1, 4, 16, 32] if not quick else [1, 4]
    repeats = 1 if quick else 3
    measure(engine, prompts(2, 32), 4, [])  # warm-up, not counted
    samples: list[tuple[StepShape, float]] = []
    for _ in range(repeats):
        for length in lengths:
            measure(engine, prompts(1, length), 1, samples)  # one prefill step
            for batch in batches:  # a prefill of the batch, then decodes at growing context
                measure(engine, prompts(batch, length), 8 if quick else 32, samples)
    description = (f"{Path(model).name} {dtype}, {threads} thread(s), {platform.processor() or platform.machine()}, "
                   f"{os.cpu_count()} CPUs; {len(samples)} steps, benchmarks/sim_calibrate.py")
    return StepCost.fit(samples, description)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPOSITORY / "src/pagoda/assets/pagoda-demo"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as each replica will run with")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cost = calibrate(args.model, args.threads, args.quick, args.dtype, args.max_model_len)
    cost.save(args.out)
    print(f"{args.out}: {cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
