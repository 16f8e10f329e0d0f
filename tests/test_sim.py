"""pagoda sim: the fleet simulator's counted quantities against a real engine, and its parts.

The simulator's claim is that its replicas are the engine's own scheduler and KV manager with only the forward
pass replaced. So on one trace, with the same step times, a fleet of real in-process engines (a tiny model
behind the same event loop and the same router) must count exactly what the simulated fleet counts: prefix-cache
hit tokens, preemptions, and every request's cached tokens and token times.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pagoda import SamplingParams
from pagoda.config import SchedulerConfig
from pagoda.engine.core.hybrid_kv_cache import HybridKVCacheManager
from pagoda.router.config import RouterConfig
from pagoda.sim.autoscale import AutoscaleConfig, Autoscaler
from pagoda.sim.cli import model_kv_groups
from pagoda.sim.fleet import Fleet, simulate
from pagoda.sim.replica import OUTPUT_TOKEN_ID, Progress, ReplicaConfig, ReplicaEngine, SimReplica
from pagoda.sim.report import percentile, summarize
from pagoda.sim.step_cost import DEFAULT_STEP_COST, StepCost, StepShape
from pagoda.sim.trace import TraceConfig, generate_trace

STEP_S = 0.01  # every step of both fleets: the comparison is about what the scheduler decides, not timing


class EngineReplica:
    """A real LLMEngine on the fleet's clock, its step split as a simulated replica's is: scheduled at the step's
    start (requests that arrived meanwhile added first), run (the model, update, outputs) at its end, STEP_S
    later, so that the router's polls in between see the same state."""

    def __init__(self, llm) -> None:
        self.engine = llm.engine
        self._inbox: list[tuple[str, list[int], int]] = []
        self._scheduled = None
        self._seen: dict[str, int] = {}

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + len(self._inbox)

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_cache.usage()

    @property
    def prefix_cache_queries(self) -> int:
        return self.engine.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.engine.scheduler.prefix_cache_hits

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, now: float) -> None:
        self._inbox.append((request_id, prompt, max_tokens))

    def start_step(self, now: float) -> float | None:
        for request_id, prompt, max_tokens in self._inbox:
            self.engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
        self._inbox.clear()
        self._scheduled = self.engine.scheduler.schedule()
        return None if self._scheduled.is_empty else now + STEP_S

    def finish_step(self, now: float) -> list[Progress]:
        scheduled, self._scheduled = self._scheduled, None
        self.engine.scheduler.schedule = lambda: scheduled  # the step that started: LLMEngine.step runs the rest
        try:
            outputs = self.engine.step()
        finally:
            del self.engine.scheduler.schedule
        progress = []
        for output in outputs:
            total = len(output.outputs[0].token_ids)  # cumulative
            new = total - self._seen.get(output.request_id, 0)
            self._seen[output.request_id] = total
            progress.append(Progress(output.request_id, new, output.finished, output.num_cached_tokens))
        return progress


def small_trace(num_conversations: int = 12, seed: int = 3) -> TraceConfig:
    return TraceConfig(num_conversations=num_conversations, conversation_rate=20.0, min_turns=2, max_turns=3,
                       num_system_prompts=2, system_prompt_tokens=40, user_tokens=(4, 20), answer_tokens=(3, 12),
                       mean_think_s=0.05, vocab_size=500, seed=seed)


@pytest.mark.parametrize(("arch", "num_replicas", "policy", "num_blocks"), [
    ("llama", 1, "cache_aware", 38),  # a small pool: evictions and preemptions
    ("llama", 2, "cache_aware", 48),
    ("llama", 2, "round_robin", 48),
    # Sliding-window layers: a block table per KV cache group, out-of-window blocks freed, hits checked per group.
    ("gemma2", 1, "cache_aware", 56),
])
def test_simulated_fleet_counts_what_real_engines_count(checkpoint, make_llm, arch, num_replicas, policy, num_blocks):
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=144, max_step_ms=0)
    model = checkpoint(arch)
    kv_groups = None if arch == "llama" else model_kv_groups(model, scheduler.max_model_len)
    replica_config = ReplicaConfig(scheduler, num_blocks=num_blocks, block_size=4, kv_groups=kv_groups)
    router_config = RouterConfig(policy=policy, default_block_size=4, poll_interval_s=0.05)
    trace = generate_trace(small_trace())
    engines: list[ReplicaEngine] = [EngineReplica(make_llm(
        model, num_kv_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=144,
        max_step_ms=0)) for _ in range(num_replicas)]
    for engine in engines:
        assert isinstance(engine, EngineReplica) and engine.engine.max_model_len == scheduler.max_model_len
        kv_cache = engine.engine.kv_cache
        assert (kv_cache.groups if isinstance(kv_cache, HybridKVCacheManager) else None) == kv_groups
    real = Fleet(trace, engines, replica_config, router_config).run()
    simulated = simulate(trace, num_replicas, replica_config, router_config, StepCost(fixed_s=STEP_S))

    real_counts = [(r.prefix_cache_queries, r.prefix_cache_hits) for r in real.replicas]
    sim_counts = [(r.prefix_cache_queries, r.prefix_cache_hits) for r in simulated.replicas]
    assert sim_counts == real_counts
    assert sum(hits for _, hits in sim_counts) > 0  # the trace shares prefixes: a cache that never hit says nothing
    assert [r.engine.scheduler.num_preemptions for r in real.replicas] == [
        r.scheduler.num_preemptions for r in simulated.replicas if isinstance(r, SimReplica)]
    assert [(r.replica, r.cached_tokens, r.first_token_s, r.finish_s, r.output_tokens) for r in simulated.records] == [
        (r.replica, r.cached_tokens, r.first_token_s, r.finish_s, r.output_tokens) for r in real.records]
    served = [r for r in simulated.records if r.replica >= 0]  # the rest: refused while every replica was full
    assert len(served) > len(simulated.records) // 2
    assert all(r.output_tokens == trace.conversations[r.conversation].turns[r.turn].answer_len for r in served)
    if num_replicas == 1 and policy == "cache_aware":  # the small pools
        assert sum(r.scheduler.num_preemptions for r in simulated.replicas if isinstance(r, SimReplica)) > 0
    for replica in simulated.replicas:
        assert isinstance(replica, SimReplica)
        replica.kv_cache.check_invariants()
        assert replica.kv_cache.num_free_blocks == replica.kv_cache.num_blocks  # every block back in the pool


def test_cache_aware_keeps_conversations_where_their_prefix_is():
    trace = generate_trace(TraceConfig(num_conversations=120, conversation_rate=4.0, vocab_size=1000, seed=1))
    config = ReplicaConfig(SchedulerConfig(max_model_len=2048), num_blocks=2048)
    cost = StepCost.load(DEFAULT_STEP_COST)
    cache_aware = summarize(simulate(trace, 4, config, RouterConfig(policy="cache_aware"), cost))
    round_robin = summarize(simulate(trace, 4, config, RouterConfig(policy="round_robin"), cost))
    assert cache_aware["served"] == round_robin["served"] == trace.num_requests
    assert cache_aware["hit_rate"] > round_robin["hit_rate"] + 0.1
    assert round_robin["busiest_share"] < 0.26  # round robin: even by construction


def test_step_cost_fit_recovers_its_coefficients():
    truth = StepCost(fixed_s=0.004, prefill_token_s=2e-5, decode_row_s=3e-4, decode_context_s=1e-7,
                     prefill_attention_s=2e-9)
    shapes = [StepShape(p, d, d * c, p * (p + 1) // 2 + p * o)
              for p in (0, 16, 128, 512) for d in (0, 1, 8) for c in (32, 300) for o in (0, 200) if p or d]
    fitted = StepCost.fit([(shape, truth.seconds(shape)) for shape in shapes])
    for got, want in zip(fitted.coefficients(), truth.coefficients()):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_step_cost_fit_drops_a_term_that_comes_out_negative():
    # seconds fall as decode rows grow: noise a fit must not turn into a negative cost
    samples = [(StepShape(p, d), 0.01 + 1e-4 * p - 1e-5 * d) for p in (10, 100, 400) for d in (0, 4, 9)]
    fitted = StepCost.fit(samples)
    assert fitted.decode_row_s == 0.0
    assert fitted.prefill_token_s == pytest.approx(1e-4, rel=0.05)


def test_step_cost_json_round_trip_and_refusals(tmp_path):
    cost = StepCost(fixed_s=0.01, prefill_token_s=1e-5, description="here")
    cost.save(tmp_path / "cost.json")
    assert StepCost.load(tmp_path / "cost.json") == cost
    (tmp_path / "bad.json").write_text(json.dumps({"fixed_s": 0.01, "per_token": 1}))
    with pytest.raises(ValueError, match="per_token"):
        StepCost.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="fixed_s"):
        StepCost(fixed_s=-1.0)


def test_trace_is_seeded_and_turns_carry_the_conversation():
    config = small_trace(seed=5)
    one, two = generate_trace(config), generate_trace(config)
    assert one.conversations == two.conversations and one.system_prompts == two.system_prompts
    conversation = next(s for s in one.conversations if len(s.turns) >= 2)
    first, second = one.prompt(conversation, 0), one.prompt(conversation, 1)
    user, answer = one.turn_tokens(conversation, 0)
    assert second[: len(first) + len(answer)] == first + answer  # turn 2 resends turn 1 and its answer
    assert first[: config.system_prompt_tokens] == one.system_prompts[conversation.system_prompt]
    assert OUTPUT_TOKEN_ID not in first + second  # simulated answers never match a recorded one
    assert generate_trace(small_trace(seed=6)).conversations != one.conversations


def test_percentile_is_linear_between_order_statistics():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_a_trace_longer_than_the_context_is_refused():
    trace = generate_trace(small_trace())
    config = ReplicaConfig(SchedulerConfig(max_model_len=64), num_blocks=64)
    with pytest.raises(ValueError, match="max_model_len 64"):
        simulate(trace, 1, config, RouterConfig(), StepCost(fixed_s=0.01))


def test_cli_writes_its_figures(tmp_path):
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "sim", "--replicas", "3", "--policy", "cache_aware", "--policy",
         "round_robin", "--num-conversations", "30", "--vocab-size", "500", "--output", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "prefix-cache hit rate" in result.stdout
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"cache_aware", "round_robin"}
    assert data["results"]["cache_aware"]["served"] == data["results"]["round_robin"]["served"] > 0
    for summary in data["results"].values():  # every routed request counted on exactly one replica
        assert len(summary["replica_requests"]) == 3
        assert sum(summary["replica_requests"]) == summary["requests"] - summary["refused"]
        assert max(summary["replica_requests"]) / sum(summary["replica_requests"]) == summary["busiest_share"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot, beside the JSON
    refused = subprocess.run([sys.executable, "-m", "pagoda", "sim", "--replicas", "0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--replicas" in refused.stdout


def test_cli_takes_a_models_kv_cache_groups(tmp_path, checkpoint):
    """--model: the replicas' KV manager on the model's groups (Gemma 2: a full and a sliding layer), as the engine
    chooses them; a directory without a config.json is refused by its path."""
    out = tmp_path / "sim.json"
    model = checkpoint("gemma2")
    command = [sys.executable, "-m", "pagoda", "sim", "--replicas", "1", "--num-conversations", "8",
               "--vocab-size", "500", "--block-size", "4"]
    result = subprocess.run([*command, "--model", str(model), "--output", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["replica"]["kv_groups"] == [{"window": None, "layers": [1]}, {"window": 24, "layers": [0]}]
    assert data["results"]["cache_aware"]["served"] > 0
    refused = subprocess.run([*command, "--model", str(tmp_path / "nowhere")], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and str(tmp_path / "nowhere") in refused.stdout


def test_request_overhead_delays_each_request_by_exactly_its_length():
    trace = generate_trace(small_trace(num_conversations=1))
    config = ReplicaConfig(SchedulerConfig(max_model_len=256), num_blocks=64, block_size=4)
    router = RouterConfig(default_block_size=4)
    direct = simulate(trace, 1, config, router, StepCost(fixed_s=0.01, prefill_token_s=1e-4))
    delayed = simulate(trace, 1, config, router, StepCost(fixed_s=0.01, prefill_token_s=1e-4, request_overhead_s=0.25))
    assert [r.ttft_s + 0.25 for r in direct.records] == pytest.approx([r.ttft_s for r in delayed.records])
    assert [r.cached_tokens for r in direct.records] == [r.cached_tokens for r in delayed.records]


# --- autoscaling -------------------------------------------------------------------------------------------------

def burst_trace(seed: int = 1) -> TraceConfig:
    """A steady trickle, a burst of eight times the rate from 20 s to 35 s, then the trickle again for a while."""
    return TraceConfig(num_conversations=190, conversation_rate=1.0, burst_start_s=20.0, burst_duration_s=15.0,
                       burst_rate=8.0, mean_think_s=1.0, vocab_size=1000, seed=seed)


def autoscaled(metric: str, target: float, trace_config: TraceConfig | None = None):
    trace = generate_trace(trace_config or burst_trace())
    config = ReplicaConfig(SchedulerConfig(max_model_len=2048, max_num_seqs=16), num_blocks=512)
    autoscale = AutoscaleConfig(min_replicas=1, max_replicas=5, metric=metric, target=target, window_s=5.0,
                                cooldown_s=15.0, startup_delay_s=5.0)
    return trace, simulate(trace, 1, config, RouterConfig(policy="round_robin"), StepCost.load(DEFAULT_STEP_COST),
                           autoscale)


def routable_spans(run) -> dict[int, list[tuple[float, float]]]:
    """slot -> [(from, until)]: when the router could send it requests (its health check answering)."""
    spans: dict[int, list[tuple[float, float]]] = {0: []}
    opened = {0: 0.0}
    for event in run.scaling.events:
        if event.kind == "ready":
            opened[event.slot] = event.t_s
        elif event.kind == "drain":
            spans.setdefault(event.slot, []).append((opened.pop(event.slot), event.t_s))
    for slot, start in opened.items():
        spans.setdefault(slot, []).append((start, float("inf")))
    return spans


@pytest.mark.parametrize(("metric", "target"), [("num_requests_waiting", 2.0), ("kv_cache_usage_perc", 0.3)])
def test_autoscaling_rises_under_a_burst_and_falls_after(metric, target):
    trace, run = autoscaled(metric, target)
    timeline = run.scaling.timeline
    assert all(1 <= sample["provisioned"] <= 5 for sample in timeline)
    assert all(sample["ready"] + sample["starting"] + sample["draining"] <= 5 for sample in timeline)  # slots
    starts = [e.t_s for e in run.scaling.events if e.kind == "start"]
    drains = [e.t_s for e in run.scaling.events if e.kind == "drain"]
    assert starts and min(starts) >= 20.0  # nothing before the burst asked for more than one replica
    assert max(sample["provisioned"] for sample in timeline) >= 3
    assert drains and max(drains) > 35.0 and timeline[-1]["provisioned"] == 1  # back to the minimum after it
    ready = [(e.slot, e.t_s) for e in run.scaling.events if e.kind == "ready"]
    started = [(e.slot, e.t_s + 5.0) for e in run.scaling.events if e.kind == "start"]
    assert ready and all(item in started for item in ready)  # each up its start-up delay after it was asked for
    # no lost request: every turn served in full, every block back in its pool
    assert len(run.records) == trace.num_requests
    assert all(r.finish_s is not None
               and r.output_tokens == trace.conversations[r.conversation].turns[r.turn].answer_len
               for r in run.records)
    for replica in run.replicas:
        replica.kv_cache.check_invariants()
        assert replica.kv_cache.num_free_blocks == replica.kv_cache.num_blocks
    assert len(run.replicas) == 1 + sum(e.kind == "ready" for e in run.scaling.events)


def test_a_draining_replica_gets_nothing_new_and_finishes_what_it_holds():
    # a busier trickle after the burst: the replicas drained then still hold requests
    _, run = autoscaled("num_requests_waiting", 2.0, dataclasses.replace(burst_trace(), conversation_rate=3.0,
                                                                          num_conversations=250))
    spans = routable_spans(run)
    for record in run.records:  # chosen only while its replica's health check answered
        assert any(start <= record.arrival_s < end for start, end in spans[record.replica]), record
    retired = {}
    for event in run.scaling.events:
        if event.kind == "retire":
            retired.setdefault(event.slot, []).append(event.t_s)
    drained_busy = [e for e in run.scaling.events if e.kind == "drain" and e.in_flight > 0]
    assert drained_busy  # the trace drains replicas that still hold requests: the case that could lose one
    for drain in drained_busy:
        held = [r for r in run.records if r.replica == drain.slot and r.arrival_s < drain.t_s
                and r.finish_s is not None and r.finish_s >= drain.t_s]
        assert len(held) == drain.in_flight  # each finished after the drain began
        retire = min(t for t in retired[drain.slot] if t >= drain.t_s)
        assert max(r.finish_s for r in held) == retire  # and the replica retired with the last of them


def test_new_replicas_start_cold():
    trace, run = autoscaled("num_requests_waiting", 2.0)
    block = 16
    for event in [e for e in run.scaling.events if e.kind == "ready"]:
        later = [r for r in run.records if r.replica == event.slot and r.arrival_s >= event.t_s]
        first = min(later, key=lambda r: r.arrival_s)
        assert first.cached_tokens == 0
        # though its system prompt was already cached on a replica that was up before it
        system = trace.conversations[first.conversation].system_prompt
        assert any(r.cached_tokens >= block for r in run.records if r.arrival_s < event.t_s
                   and trace.conversations[r.conversation].system_prompt == system)
    engines = run.replicas
    assert len({id(engine) for engine in engines}) == len(engines)  # a restarted slot gets a new replica
    assert len(engines) == 1 + sum(e.kind == "ready" for e in run.scaling.events)


def test_autoscaler_holds_its_bounds_and_cools_down():
    scaler = Autoscaler(AutoscaleConfig(min_replicas=2, max_replicas=4, target=2.0, window_s=10.0, cooldown_s=30.0))
    assert scaler.decide(0.0, 2) == 2  # no poll yet: no opinion
    scaler.observe(0.0, [50.0, 50.0])
    assert scaler.decide(0.0, 2) == 4  # 100 waiting wants 50 replicas: held at max
    scaler.observe(5.0, [0.0] * 4)
    assert scaler.windowed == pytest.approx(50.0)  # both polls within the window
    assert scaler.decide(5.0, 4) == 4
    scaler.observe(11.0, [0.0] * 4)
    assert scaler.windowed == 0.0  # the first poll has left the window
    assert scaler.decide(11.0, 4) == 4  # cooling down: 11 s since it scaled up
    assert scaler.decide(30.0, 4) == 2  # cooled down: the minimum, never below
    scaler.observe(31.0, [5.0, 1.0])
    assert scaler.decide(31.0, 2) == 3  # scaling up needs no cool-down: ceil(6 / 2)
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="metric"):
        AutoscaleConfig(metric="gpu_util")


def test_a_burst_raises_the_arrival_rate_for_its_duration():
    config = burst_trace()
    starts = [s.start_s for s in generate_trace(config).conversations]
    inside = sum(1 for t in starts if 20.0 <= t < 35.0)
    before = sum(1 for t in starts if t < 20.0)
    assert 80 <= inside <= 160 and 4 <= before <= 36  # 8/s for 15 s; 1/s for 20 s
    plain = dataclasses.replace(config, burst_duration_s=0.0, burst_rate=0.0)
    assert [s.start_s for s in generate_trace(plain).conversations][:before] == starts[:before]  # same draws before it


def test_cli_autoscales_and_refuses_its_flags_alone(tmp_path):
    out = tmp_path / "auto.json"
    result = subprocess.run(
        [sys.executable, "-m", "pagoda", "sim", "--replicas", "1", "--autoscale", "--max-replicas", "3",
         "--autoscale-window", "5", "--autoscale-cooldown", "10", "--replica-startup-delay", "2",
         "--autoscale-target", "1", "--num-conversations", "80", "--conversation-rate", "1", "--burst-start", "5",
         "--burst-duration", "8", "--burst-rate", "20", "--max-num-seqs", "4", "--vocab-size", "500",
         "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "autoscaling: peak" in result.stdout
    scaling = json.loads(out.read_text())["results"]["cache_aware"]["autoscale"]
    assert scaling["config"]["max_replicas"] == 3 and scaling["scale_ups"] >= 1
    assert 1 <= scaling["peak_replicas"] <= 3 and len(scaling["buckets"]) == 30
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    for flags, said in ((["--min-replicas", "2"], "--min-replicas needs --autoscale"),
                        (["--autoscale", "--replicas", "9", "--max-replicas", "4"], "--replicas 9")):
        refused = subprocess.run([sys.executable, "-m", "pagoda", "sim", *flags], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and said in refused.stdout
