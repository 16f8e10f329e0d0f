"""pagoda sim: the fleet simulator's counted quantities against a real engine, and its parts.

The simulator's claim is that its replicas are the engine's own scheduler and KV manager with only the forward
pass replaced. So on one trace, with the same step times, a fleet of real in-process engines (a tiny model
behind the same event loop and the same router) must count exactly what the simulated fleet counts: prefix-cache
hit tokens, preemptions, and every request's cached tokens and token times.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda import SamplingParams
from pagoda.config import SchedulerConfig
from pagoda.engine.core.hybrid_kv_cache import HybridKVCacheManager
from pagoda.router.config import RouterConfig
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


def small_trace(num_sessions: int = 12, seed: int = 3) -> TraceConfig:
    return TraceConfig(num_sessions=num_sessions, session_rate=20.0, min_turns=2, max_turns=3, num_system_prompts=2,
                       system_prompt_tokens=40, user_tokens=(4, 20), answer_tokens=(3, 12), mean_think_s=0.05,
                       vocab_size=500, seed=seed)


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
    assert all(r.output_tokens == trace.sessions[r.session].turns[r.turn].answer_len for r in served)
    if num_replicas == 1 and policy == "cache_aware":  # the small pools
        assert sum(r.scheduler.num_preemptions for r in simulated.replicas if isinstance(r, SimReplica)) > 0
    for replica in simulated.replicas:
        assert isinstance(replica, SimReplica)
        replica.kv_cache.check_invariants()
        assert replica.kv_cache.num_free_blocks == replica.kv_cache.num_blocks  # every block back in the pool


def test_cache_aware_keeps_conversations_where_their_prefix_is():
    trace = generate_trace(TraceConfig(num_sessions=120, session_rate=4.0, vocab_size=1000, seed=1))
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
    assert one.sessions == two.sessions and one.system_prompts == two.system_prompts
    session = next(s for s in one.sessions if len(s.turns) >= 2)
    first, second = one.prompt(session, 0), one.prompt(session, 1)
    user, answer = one.turn_tokens(session, 0)
    assert second[: len(first) + len(answer)] == first + answer  # turn 2 resends turn 1 and its answer
    assert first[: config.system_prompt_tokens] == one.system_prompts[session.system_prompt]
    assert OUTPUT_TOKEN_ID not in first + second  # simulated answers never match a recorded one
    assert generate_trace(small_trace(seed=6)).sessions != one.sessions


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
         "round_robin", "--num-sessions", "30", "--vocab-size", "500", "--output", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "prefix-cache hit rate" in result.stdout
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"cache_aware", "round_robin"}
    assert data["results"]["cache_aware"]["served"] == data["results"]["round_robin"]["served"] > 0
    refused = subprocess.run([sys.executable, "-m", "pagoda", "sim", "--replicas", "0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "--replicas" in refused.stdout


def test_cli_takes_a_models_kv_cache_groups(tmp_path, checkpoint):
    """--model: the replicas' KV manager on the model's groups (Gemma 2: a full and a sliding layer), as the engine
    chooses them; a directory without a config.json is refused by its path."""
    out = tmp_path / "sim.json"
    model = checkpoint("gemma2")
    command = [sys.executable, "-m", "pagoda", "sim", "--replicas", "1", "--num-sessions", "8", "--vocab-size", "500",
               "--block-size", "4"]
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
    trace = generate_trace(small_trace(num_sessions=1))
    config = ReplicaConfig(SchedulerConfig(max_model_len=256), num_blocks=64, block_size=4)
    router = RouterConfig(default_block_size=4)
    direct = simulate(trace, 1, config, router, StepCost(fixed_s=0.01, prefill_token_s=1e-4))
    delayed = simulate(trace, 1, config, router, StepCost(fixed_s=0.01, prefill_token_s=1e-4, request_overhead_s=0.25))
    assert [r.ttft_s + 0.25 for r in direct.records] == pytest.approx([r.ttft_s for r in delayed.records])
    assert [r.cached_tokens for r in direct.records] == [r.cached_tokens for r in delayed.records]
