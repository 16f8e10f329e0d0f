"""`pagoda sim`: a generated multi-turn trace over N simulated replicas, for one or more router policies."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from pagoda.calc.shapes import shape_from_path
from pagoda.config import SchedulerConfig
from pagoda.kv_groups import KVCacheGroup, kv_cache_groups
from pagoda.router.config import POLICIES, RouterConfig
from pagoda.sim.autoscale import METRICS, AutoscaleConfig
from pagoda.sim.replica import ReplicaConfig
from pagoda.sim.step_cost import DEFAULT_STEP_COST, StepCost
from pagoda.sim.trace import TraceConfig, generate_trace

# flag -> (TraceConfig field, type, help)
TRACE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--num-conversations": ("num_conversations", int, "conversations in the trace"),
    "--conversation-rate": ("conversation_rate", float, "conversations started per second (Poisson)"),
    "--min-turns": ("min_turns", int, "fewest turns of a conversation"),
    "--max-turns": ("max_turns", int, "most turns of a conversation"),
    "--num-system-prompts": ("num_system_prompts", int, "distinct system prompts (Zipf popularity)"),
    "--system-prompt-tokens": ("system_prompt_tokens", int, "tokens of each system prompt"),
    "--think-time": ("mean_think_s", float, "mean seconds between an answer and the next turn (exponential)"),
    "--vocab-size": ("vocab_size", int, "token ids are drawn below this"),
    "--burst-start": ("burst_start_s", float, "second the burst begins"),
    "--burst-duration": ("burst_duration_s", float, "seconds the burst lasts (0: no burst)"),
    "--burst-rate": ("burst_rate", float, "conversations started per second during the burst"),
}
# flag -> (AutoscaleConfig field, type, help); each needs --autoscale
AUTOSCALE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--min-replicas": ("min_replicas", int, "fewest replicas"),
    "--max-replicas": ("max_replicas", int, "most replicas (the router lists this many)"),
    "--autoscale-target": ("target", float, "per replica: waiting requests, or KV usage (0-1); default 4 or 0.7"),
    "--autoscale-window": ("window_s", float, "seconds of polls the metric is averaged over"),
    "--autoscale-cooldown": ("cooldown_s", float, "no scaling down until this many seconds after the last change"),
    "--replica-startup-delay": ("startup_delay_s", float, "seconds from asking for a replica to its first request"),
}
# flag -> (RouterConfig field, type, help): the routing knobs `pagoda route` has under the same names
ROUTER_FLAGS: dict[str, tuple[str, type, str]] = {
    "--hit-weight": ("hit_weight", float, "cost weight of each uncached prompt token"),
    "--queue-weight-tokens": ("queue_weight_tokens", float, "cost, in tokens, of each request waiting"),
    "--kv-weight-tokens": ("kv_weight_tokens", float, "cost, in tokens, of a full KV cache"),
    "--max-replica-waiting": ("max_waiting_requests", int, "skip a replica with this many requests waiting"),
    "--hot-prefix-share": ("hot_prefix_share", float, "most share of one prefix's requests on one replica"),
    "--index-ttl": ("index_ttl_s", float, "seconds a routed block stays in a replica's index"),
    "--poll-interval": ("poll_interval_s", float, "seconds between the router's polls of each replica"),
}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "sim", help="simulate a fleet: the real router and schedulers, a step-cost model for the forward pass",
        description="Replays a generated multi-turn trace over N simulated replicas behind the router's real "
                    "policies; each replica runs the engine's own scheduler and KV manager, its steps timed by a "
                    "step-cost model (docs/sim.md).")
    sim.add_argument("--replicas", type=int, default=4,
                     help="simulated replicas (default 4); with --autoscale, those up at the start")
    sim.add_argument("--policy", action="append", choices=POLICIES, default=None,
                     help="routing policy; repeat to compare several on the same trace (default cache_aware)")
    sim.add_argument("--step-cost", type=Path, default=DEFAULT_STEP_COST,
                     help="the step-cost model's JSON (benchmarks/sim_calibrate.py writes one; default: the built-in "
                          "model's, measured on a 2-vCPU host)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the trace and of the router's random choices")
    sim.add_argument("--output", type=Path, default=None,
                     help="write the configuration and figures here as JSON, and a plot beside it (.png)")
    sim.add_argument("--no-plot", action="store_true", help="with --output: write no plot")
    trace = sim.add_argument_group("trace")
    defaults = TraceConfig()
    for flag, (name, kind, text) in TRACE_FLAGS.items():
        trace.add_argument(flag, dest=name, type=kind, default=getattr(defaults, name),
                           help=f"{text} (default %(default)s)")
    for flag, name in (("--user-tokens", "user_tokens"), ("--answer-tokens", "answer_tokens")):
        trace.add_argument(flag, type=int, nargs=2, metavar=("LOW", "HIGH"), default=list(getattr(defaults, name)),
                           help=f"length range of each turn's {name.split('_')[0]} message (default %(default)s)")
    engine = sim.add_argument_group("each replica (pagoda serve's flags)")
    scheduler = SchedulerConfig()
    engine.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks per replica (default 2048)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    for flag, name in (("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
                       ("--max-model-len", "max_model_len")):
        engine.add_argument(flag, type=int, default=getattr(scheduler, name), help="(default %(default)s)")
    engine.add_argument("--max-step-ms", type=float, default=scheduler.max_step_ms, help="(default %(default)s)")
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    engine.add_argument("--model", type=Path, default=None,
                        help="a model directory whose KV layout the replicas take (its config.json's sliding-window "
                             "layers each get a block table that frees what falls out of the window); default: one "
                             "table over every layer")
    router = sim.add_argument_group("the router (pagoda route's flags)")
    for flag, (name, kind, text) in ROUTER_FLAGS.items():
        router.add_argument(flag, dest=name, type=kind, default=getattr(RouterConfig(), name),
                            help=f"{text} (default %(default)s)")
    scaling = sim.add_argument_group("autoscaling (docs/sim.md)")
    scaling.add_argument("--autoscale", action="store_true",
                         help="add and remove replicas as an HPA on the replicas' own gauge would")
    scaling.add_argument("--autoscale-metric", choices=list(METRICS), default=None,
                         help="the gauge it scales on, summed over the replicas up (default num_requests_waiting)")
    auto_defaults = AutoscaleConfig()
    for flag, (name, kind, text) in AUTOSCALE_FLAGS.items():
        default = "" if name == "target" else f" (default {getattr(auto_defaults, name)})"
        scaling.add_argument(flag, dest=f"autoscale_{name}", type=kind, default=None, help=text + default)
    sim.set_defaults(func=run)


def configs(args: argparse.Namespace) -> tuple[TraceConfig, ReplicaConfig, RouterConfig]:
    trace = TraceConfig(**{name: getattr(args, name) for name, _, _ in TRACE_FLAGS.values()},
                        user_tokens=tuple(args.user_tokens), answer_tokens=tuple(args.answer_tokens), seed=args.seed)
    replica = ReplicaConfig(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, max_step_ms=args.max_step_ms),
        num_blocks=args.num_kv_blocks, block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        kv_groups=None if args.model is None else model_kv_groups(args.model, args.max_model_len))
    router = RouterConfig(**{name: getattr(args, name) for name, _, _ in ROUTER_FLAGS.values()},
                          default_block_size=args.block_size, seed=args.seed)
    return trace, replica, router


def model_kv_groups(model: Path, max_model_len: int) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups the engine gives the model at this context length (from its config.json alone)."""
    architecture = shape_from_path(model).architecture
    assert architecture is not None  # a config.json always names its layers
    return kv_cache_groups(architecture.sliding_windows, architecture.num_layers, max_model_len)


def autoscale_config(args: argparse.Namespace) -> AutoscaleConfig | None:
    given = {name: getattr(args, f"autoscale_{name}") for name, _, _ in AUTOSCALE_FLAGS.values()}
    given["metric"] = args.autoscale_metric
    given = {name: value for name, value in given.items() if value is not None}
    if not args.autoscale:
        if given:
            flags = {name: flag for flag, (name, _, _) in AUTOSCALE_FLAGS.items()} | {"metric": "--autoscale-metric"}
            raise ValueError(f"{flags[next(iter(given))]} needs --autoscale")
        return None
    metric = given.get("metric", AutoscaleConfig.metric)
    config = AutoscaleConfig(**{"target": METRICS[metric], **given})
    if not config.min_replicas <= args.replicas <= config.max_replicas:
        raise ValueError(f"--replicas {args.replicas} must be within --min-replicas {config.min_replicas} and "
                         f"--max-replicas {config.max_replicas}")
    return config


def run(args: argparse.Namespace) -> int:
    from pagoda.sim.fleet import simulate  # here: the router it drives imports the web stack
    from pagoda.sim.report import format_summary, summarize

    try:
        trace_config, replica_config, router_config = configs(args)
        cost = StepCost.load(args.step_cost)
        if args.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        autoscale = autoscale_config(args)
    except (ValueError, OSError) as error:
        print(f"pagoda sim: {error}")
        return 2
    trace = generate_trace(trace_config)
    print(f"trace: {len(trace.conversations)} conversations, {trace.num_requests} requests; step cost: "
          f"{cost.description or args.step_cost}")
    results: dict[str, Any] = {}
    for policy in args.policy or ["cache_aware"]:
        started = time.perf_counter()
        run_ = simulate(trace, args.replicas, replica_config, dataclasses.replace(router_config, policy=policy), cost,
                        autoscale)
        summary = {**summarize(run_), "wall_s": time.perf_counter() - started}
        results[policy] = summary
        print(f"\n{policy} ({summary['wall_s']:.1f} s of wall time)\n{format_summary(summary)}", flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps({
            "trace": dataclasses.asdict(trace_config), "replica": dataclasses.asdict(replica_config),
            "router": dataclasses.asdict(router_config), "step_cost": dataclasses.asdict(cost),
            "replicas": args.replicas, "autoscale": None if autoscale is None else dataclasses.asdict(autoscale),
            "results": results}, indent=2) + "\n")
        print(f"\nwrote {args.output}")
        if not args.no_plot:
            _write_plot(results, args.output.with_suffix(".png"),
                        f"pagoda sim: {args.replicas} replicas, {trace.num_requests} requests")
    return 0


def _write_plot(results: dict[str, Any], path: Path, title: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:  # it comes with the bench extra
        print("no plot: matplotlib is not installed (pip install 'pagoda[bench]', or pass --no-plot)")
        return
    from pagoda.sim.plots import plot_results

    print(f"wrote {plot_results(results, path, title)}")
