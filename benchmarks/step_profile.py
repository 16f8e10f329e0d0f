"""Where one decode step's time goes, and whether the step is memory-, compute- or overhead-bound.

For each (model, config, batch): requests with 128-token prompts are prefilled (untimed), then decode
steps are measured four ways, one after the other on the same running batch:

  plain         engine.step() wall clock, nothing attached: the reference step time (decode steps run
                through the native decode stack where it applies, as in the engine)
  module        the same with the native stack off: every layer through the modules, as profiled next
  instrumented  timers around LLMEngine.step's parts (schedule / runner.execute_model / scheduler.update /
                outputs), inside execute (build_metadata, model forward, LM head, sampling metadata,
                sample), forward hooks on every linear (qkv, o, gate_up, down) and timers around the
                attention backend; inside the forward: linears vs attention vs the rest (norms, rotary,
                residuals, module calls). pagoda's AVX-512 kernels are not aten ops: this is how they count
  profiler      torch.profiler over a few steps: top aten ops by self time (the kernels are invisible)

Verdict per row: matmuls (linears + LM head) against the memory floor (weight + KV bytes / measured
read bandwidth) and the compute floor (FLOPs / the fastest measured matmul rate for the config at the
model's gate_up shape with 256 rows; int8: the faster of torch._weight_int8pack_mm and bf16): memory-
or compute-bound when the matmuls dominate the step, overhead-bound when the rest does.

    python benchmarks/step_profile.py [--threads 2] [--steps 32] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict

import torch
from bandwidth import read_bandwidth
from common import (
    CONFIGS,
    TORCH_DTYPES,
    Gemm,
    add_common_args,
    environment,
    gemm_seconds,
    kv_read_bytes,
    linear_flops,
    load_average,
    log,
    make_llm,
    make_prompts,
    model_gemms,
    set_threads,
    weight_bytes,
    write_json,
)

import pagoda.engine.runner as runner_module
import pagoda.model.attention as attention_module

LINEAR_CLASSES = ("Linear", "DenseLinear", "Int8Linear")


class StepTimers:
    """Per-step sums of named timers; wrap() instruments a callable, hook() a module."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._undo: list = []
        self._starts: dict[int, float] = {}

    def wrap(self, owner, attribute: str, name: str) -> None:
        original, own = getattr(owner, attribute), attribute in vars(owner)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - started

        setattr(owner, attribute, timed)
        self._undo.append(lambda: setattr(owner, attribute, original) if own else delattr(owner, attribute))

    def hook(self, module: torch.nn.Module, name: str) -> None:
        def before(mod, _inputs):
            self._starts[id(mod)] = time.perf_counter()

        def after(mod, _inputs, _output):
            self.current[name] += time.perf_counter() - self._starts.pop(id(mod))

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        self._undo.append(lambda: [h.remove() for h in handles])

    def end_step(self, step_seconds: float) -> None:
        self.current["step"] = step_seconds
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def medians(self) -> dict[str, float]:
        names = {name for step in self.steps for name in step}
        return {name: statistics.median(step.get(name, 0.0) for step in self.steps) for name in sorted(names)}


def timed_steps(engine, count: int, timers: StepTimers | None = None, before=None) -> list[float]:
    samples = []
    for _ in range(count):
        if before is not None:
            before()  # untimed: adds the next prefill's request
        started = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - started)
        if timers is not None:
            timers.end_step(samples[-1])
    return samples


def instrument(engine) -> StepTimers:
    """Timers around step's parts and inside the runner, hooks on every linear, timers on attention."""
    timers = StepTimers()
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.runner, "execute_model", "execute")
    timers.wrap(engine.scheduler, "update", "update")
    timers.wrap(engine.output_processor, "process_outputs", "outputs")
    timers.hook(engine.model, "forward")
    timers.wrap(engine.model, "compute_logits", "lm_head")
    timers.wrap(attention_module, "build_metadata", "build_metadata")
    for function in ("sample", "build_sampling_metadata"):
        timers.wrap(runner_module, function, function)
    for name, module in engine.model.layers.named_modules():
        if type(module).__name__ in LINEAR_CLASSES:
            timers.hook(module, f"linear.{name.rsplit('.', 1)[-1]}")
    timers.wrap(engine.model.backend, "forward", "attention")
    timers.wrap(engine.model.backend, "rotate_and_write_kv", "rotary_kv_write")
    return timers


def profiler_table(engine, steps: int, before=None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(timed_steps(engine, steps, before=before))
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    top = [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
           for e in events[:15]]
    # Ops with no aten parent (called from Python, or from a custom kernel): each pays eager dispatch once.
    top_level = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    return {"wall_ms_per_step": wall / steps * 1e3, "aten_self_ms_per_step": total_self / steps * 1e3,
            "top_level_aten_ops_per_step": top_level / steps, "top": top}


def matmul_rates(config_name: str, model_config, rows: int) -> dict[str, float]:
    """FLOP/s of the model's gate_up GEMM at `rows` rows, for each kind a config's matmuls could run as:
    its own (int8: torch._weight_int8pack_mm, what the engine runs above 8 rows), and for int8 also bf16
    (dequantized weights). The compute floor uses the fastest: the machine's rate, not one op's."""
    gemm = next(g for g in model_gemms(model_config) if g.name == "gate_up_proj")
    rates = {}
    for kind in {"int8": ["int8", "bf16"]}.get(config_name, [config_name]):
        seconds = statistics.median(gemm_seconds(kind, rows, Gemm(gemm.name, gemm.k, gemm.n, 1), 3))
        rates[kind] = 2 * rows * gemm.k * gemm.n / seconds
    return rates


def verdict(p: dict) -> str:
    """The biggest of matmuls / attention / everything else names the bound."""
    step, matmul, attention = p["instrumented_step_ms"], p["matmul_ms"], p["breakdown_ms"]["attention"]
    overhead = step - matmul - attention
    others = {k: v for k, v in p["breakdown_ms"].items() if k not in ("matmuls", "attention")}
    biggest = max(others.items(), key=lambda item: item[1])
    if overhead >= max(matmul, attention):
        return (f"overhead-bound: matmuls {matmul:.1f} + attention {attention:.1f} of {step:.1f} ms; the rest "
                f"{overhead:.1f} ms, most of it {biggest[0]} ({biggest[1]:.1f} ms)")
    if attention > matmul:
        rate = p["kv_bytes"] / (attention / 1e3) / 1e9
        reads = "" if str(p["batch"]).startswith("prefill") else (
            f", reading {p['kv_bytes'] / 1e6:.0f} MB of KV at {rate:.1f} GB/s")
        return f"attention-bound: attention {attention:.1f} of {step:.1f} ms{reads}; matmuls {matmul:.1f} ms"
    kind = "memory" if p["memory_floor_ms"] >= p["compute_floor_ms"] else "compute"
    floor = max(p["memory_floor_ms"], p["compute_floor_ms"])
    return (f"{kind}-bound: matmuls {matmul:.1f} of {step:.1f} ms, at {floor / matmul:.2f} of the {kind} floor "
            f"({floor:.1f} ms); attention {attention:.1f} ms, the rest {overhead:.1f} ms")


def profile_one(model_dir: str, name: str, config: str, spec: str, args) -> dict:
    """spec: a decode batch size ("1", "32"), or "prefill1024" for one prompt of that many tokens."""
    from pagoda import SamplingParams

    prefill_tokens = int(spec.removeprefix("prefill")) if spec.startswith("prefill") else 0
    batch, steps = (1, args.prefill_steps) if prefill_tokens else (int(spec), args.steps)
    max_len = prefill_tokens + 8 if prefill_tokens else args.prompt_len + 4 * steps + 16
    llm = make_llm(model_dir, config, batch, max_len, max_batched_tokens=max(4096, prefill_tokens),
                   enable_prefix_caching=False)
    engine, model_config = llm.engine, llm.engine.model_config
    before, counter, add_request = None, iter(range(1 << 30)), engine.add_request
    if prefill_tokens:
        def before():
            index = next(counter)
            prompt = make_prompts(1, prefill_tokens, model_config.vocab_size, seed=index)[0]
            add_request(f"prefill-{index}", prompt, SamplingParams(temperature=0, max_tokens=1))

        timed_steps(engine, 1, before=before)  # warm-up
        context = [prefill_tokens]
    else:
        params = SamplingParams(temperature=0, max_tokens=4 * steps + 12, ignore_eos=True)
        for index, prompt in enumerate(make_prompts(batch, args.prompt_len, model_config.vocab_size, seed=7)):
            engine.add_request(f"profile-{index}", prompt, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()  # prefill, untimed
        timed_steps(engine, 4)  # warm-up decodes
    plain = timed_steps(engine, steps, before=before)
    # The breakdown is of the module path: hooks and timers cannot see inside the native decode stack
    # (model/native_decode.py, the backend's decode runner), which runs the same kernels from one call.
    # Its plain step is timed too; the runner is set aside while the module path is profiled.
    backend = engine.model.backend
    native, backend.decode_runner = backend.decode_runner, None
    module_plain = plain if native is None or prefill_tokens else timed_steps(engine, steps, before=before)
    timers = instrument(engine)
    timed_steps(engine, steps, timers, before=before)
    timers.remove()
    profiled = profiler_table(engine, 1 if prefill_tokens else max(2, steps // 4), before=before)
    backend.decode_runner = native
    if not prefill_tokens:
        context = [r.num_computed_tokens + 1 for r in engine.scheduler.running]
        engine.abort_request([f"profile-{i}" for i in range(batch)])

    dtype = TORCH_DTYPES[CONFIGS[config][0]]
    wbytes, kvbytes = weight_bytes(engine.model), kv_read_bytes(model_config, dtype, context)
    del llm, engine
    gc.collect()
    bandwidth = statistics.median(read_bandwidth(wbytes, 3))
    rows = prefill_tokens or batch
    rates = matmul_rates(config, model_config, prefill_tokens or 256)
    rate = max(rates.values())
    ms = {name: seconds * 1e3 for name, seconds in timers.medians().items()}
    linears = sum(v for k, v in ms.items() if k.startswith("linear."))
    attention = ms["attention"] + ms["rotary_kv_write"]
    in_execute = ("build_metadata", "forward", "lm_head", "build_sampling_metadata", "sample")
    breakdown = {  # medians over the instrumented steps; their sum is close to the instrumented step
        "matmuls": linears + ms["lm_head"],
        "attention": attention,
        "forward other (norms, residual adds, gate, module calls)": ms["forward"] - linears - attention,
        "sampling (metadata + sample)": ms["build_sampling_metadata"] + ms["sample"],
        "attention metadata": ms["build_metadata"],
        "runner other (batch tensors)": ms["execute"] - sum(ms[k] for k in in_execute),
        "schedule": ms["schedule"], "update": ms["update"], "outputs (detokenize)": ms["outputs"],
        "step other": ms["step"] - ms["schedule"] - ms["execute"] - ms["update"] - ms["outputs"],
    }
    result = {
        "model": name, "config": config, "batch": spec, "steps": steps,
        "step_ms": statistics.median(plain) * 1e3, "plain_step_s": plain, "native_decode": native is not None,
        "module_step_ms": statistics.median(module_plain) * 1e3, "instrumented_step_ms": ms["step"],
        "timer_medians_ms": ms, "instrumented_steps_s": timers.steps, "breakdown_ms": breakdown,
        "matmul_ms": breakdown["matmuls"], "profiler": profiled,
        "weight_bytes": wbytes, "kv_bytes": kvbytes, "bandwidth_bytes_per_s": bandwidth,
        "matmul_flop_per_s": rate, "matmul_flop_per_s_by_kind": rates,
        "memory_floor_ms": (wbytes + kvbytes) / bandwidth * 1e3,
        "compute_floor_ms": linear_flops(model_config, rows, batch) / rate * 1e3,
    }
    result["verdict"] = verdict(result)
    return result


def print_row(p: dict) -> None:
    print(f"\n{p['model']} {p['config']} batch {p['batch']}: step {p['step_ms']:.1f} ms; "
          f"memory floor {p['memory_floor_ms']:.1f} ms "
          f"({p['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s), compute floor {p['compute_floor_ms']:.1f} ms "
          f"({p['matmul_flop_per_s'] / 1e9:.0f} GFLOP/s)")
    print(f"    module path: step {p['module_step_ms']:.1f} ms; instrumented {p['instrumented_step_ms']:.1f} ms "
          "(timer overhead included), of which:")
    for part, ms in p["breakdown_ms"].items():
        print(f"    {part:<56}{ms:>9.2f} ms {ms / p['instrumented_step_ms'] * 100:>6.1f}%")
    top = ", ".join(f"{t['op']} {t['self_ms_per_step']:.2f}" for t in p["profiler"]["top"][:6])
    print(f"    profiler: {p['profiler']['top_level_aten_ops_per_step']:.0f} top-level aten ops per step; "
          f"self ms/step: {top}")
    print(f"    -> {p['verdict']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, "benchmarks/results/step_profile.json")
    parser.add_argument("--models-dir", default="models")
    parser.add_argument("--runs", default="bench-125m:fp32:1,bench-125m:bf16:1,bench-125m:int8:1,"
                        "bench-125m:fp32:32,bench-125m:bf16:32,bench-125m:int8:32,"
                        "bench-1b:fp32:1,bench-1b:bf16:1,bench-1b:int8:1,bench-125m:bf16:prefill1024,bench-1b:bf16:prefill1024",
                        help="model:config:batch, ... (batch 'prefillN': one N-token prompt)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--prefill-steps", type=int, default=3, help="prefills per measurement")
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prefill_steps = 6, 1
        args.runs = ",".join(r for r in args.runs.split(",") if not r.startswith("bench-1b"))
    set_threads(args.threads)
    load_start = load_average()
    log(f"step profile: torch threads {args.threads}, load average {load_start}")
    results = []
    runs = [r.split(":") for r in args.runs.split(",")]
    for index, (model, config, batch) in enumerate(runs):
        log(f"[{index + 1}/{len(runs)}] {model} {config} batch {batch}")
        results.append(profile_one(f"{args.models_dir}/{model}", model, config, batch, args))
        print_row(results[-1])
    print(f"\n{'model':<12}{'config':<7}{'batch':>12}{'step ms':>10}{'matmul %':>10}  verdict")
    for p in results:
        print(f"{p['model']:<12}{p['config']:<7}{p['batch']:>12}{p['step_ms']:>10.1f}"
              f"{p['matmul_ms'] / p['instrumented_step_ms'] * 100:>9.0f}%  {p['verdict'].split(':')[0]}")
    write_json(args.out, {"config": vars(args), "environment": environment(load_start), "results": results})


if __name__ == "__main__":
    main()
