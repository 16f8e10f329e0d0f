"""Lab: how much prefill does cache-aware routing save over round robin, and what does it cost in balance?

The knob is the router's policy (`pagoda route --policy`): round_robin, then cache_aware. The replicas are
engines in this process, and the router is the `Router` object `pagoda route` runs, choosing for each request
and counting its load until it finishes. The workload: multi-turn conversations, each with its own opening
context; each turn sends the whole history (earlier turns, the replies as the engine wrote them, a new user
message), so a turn's prompt begins with everything its conversation's previous turn computed. The turns of
all conversations go out in rounds, shuffled, every request of a round in flight together.

The predictions are the prefix cache's rules: a replica serves from cache the leading whole blocks of a prompt
that it computed before (never the block with the last token), so given the routes, each request's hit is
counted in advance from the blocks each replica has computed. From the workload alone: if every turn found
its history (one replica per conversation), the hit rate would be the ideal; round robin sends a turn to the
replica of the previous one about 1 time in R.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Any

from pagoda.block_hash import hash_block_chain, max_cacheable_blocks
from pagoda.labs.result import Cell, LabResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes

NAME = "router-policies"
QUESTION = "How much prefill does cache-aware routing save over round robin, and at what balance?"
POLICIES = ("round_robin", "cache_aware")
OPENING_TOKENS, USER_TOKENS, REPLY_TOKENS = 48, 16, 16


def run(model: str, quick: bool) -> LabResult:
    from pagoda import LLM

    num_replicas, conversations, turns = (2, 8, 4) if quick else (3, 24, 6)
    rows: list[dict[str, Cell]] = []
    for policy in POLICIES:
        engines = [LLM(model, enable_prefix_caching=True, max_step_ms=0) for _ in range(num_replicas)]
        block = engines[0].engine.describe().kv_cache.block_size
        served = _serve(engines, policy, conversations, turns, block)
        del engines
        prompt_tokens = sum(r["prompt_tokens"] for r in served)
        hits = sum(r["hit_tokens"] for r in served)
        per_replica = Counter(r["replica"] for r in served)
        computed: Counter[int] = Counter()
        for r in served:
            computed[r["replica"]] += r["prompt_tokens"] - r["hit_tokens"]
        ideal = sum(r["ideal_hit_tokens"] for r in served)
        rows.append({
            "policy": policy, "requests": len(served), "prompt_tokens": prompt_tokens,
            "napkin_hit_rate": ideal / prompt_tokens / (num_replicas if policy == "round_robin" else 1),
            "predicted_hit_tokens": sum(r["predicted_hit_tokens"] for r in served), "hit_tokens": hits,
            "hit_rate": hits / prompt_tokens, "busiest_share": max(per_replica.values()) / len(served),
            "busiest_prefill_share": max(computed.values()) / sum(computed.values()),
        })
    round_robin, cache_aware = rows
    holds = (all(row["hit_tokens"] == row["predicted_hit_tokens"] for row in rows)
             and _number(cache_aware["hit_tokens"]) > 1.5 * _number(round_robin["hit_tokens"]))
    return LabResult(
        lab=NAME, question=QUESTION,
        columns=[("policy", "policy"), ("requests", "requests"), ("prompt_tokens", "prompt tokens"),
                 ("napkin_hit_rate", "hit rate: napkin"), ("predicted_hit_tokens", "hit tokens: from routes"),
                 ("hit_tokens", "hit tokens: real"), ("hit_rate", "hit rate"),
                 ("busiest_share", "busiest: requests"), ("busiest_prefill_share", "busiest: prefill")],
        rows=rows,
        lesson=("A turn finds its history only on the replica that computed it. Round robin sends it there about "
                "once in R turns, and otherwise to a replica holding at most an older, shorter part of it; "
                "cache-aware routing follows the conversation and serves its whole history from cache, at a "
                "balance the load term keeps near even."),
        lesson_holds=holds,
        settings={"model": model, "replicas": num_replicas, "conversations": conversations, "turns": turns,
                  "opening_tokens": OPENING_TOKENS, "user_tokens": USER_TOKENS, "reply_tokens": REPLY_TOKENS,
                  "quick": quick},
    )


def _serve(engines: list[Any], policy: str, conversations: int, turns: int, block: int) -> list[dict[str, Any]]:
    """Runs the conversations through a router over the engines; per request: its replica, prompt tokens, hit
    tokens (the engine's count), and the hits predicted from the blocks each replica has computed."""
    from pagoda import SamplingParams
    from pagoda.router.config import RouterConfig  # here: the router's modules load pydantic
    from pagoda.router.core import Router
    from pagoda.router.policies import RoutedPrompt

    ticks = iter(range(1 << 30))  # the router's clock: one tick a decision, so nothing expires mid-run
    urls = [f"replica-{index}" for index in range(len(engines))]
    router = Router(urls, RouterConfig(policy=policy, default_block_size=block, seed=0), clock=lambda: next(ticks))
    for replica in router.replicas:
        router.set_health(replica, True)
    computed: list[set[bytes]] = [set() for _ in engines]  # the block hashes each replica has computed
    rng = random.Random(0)  # the same conversations under both policies
    vocab = len(engines[0].get_tokenizer())
    histories = [[rng.randrange(10, vocab) for _ in range(OPENING_TOKENS)] for _ in range(conversations)]
    previous_lengths = [0] * conversations  # tokens whose KV the conversation's previous turn computed
    params = SamplingParams(max_tokens=REPLY_TOKENS, ignore_eos=True, temperature=0.0)
    served = []
    for _ in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        routed = []
        for conversation in order:
            histories[conversation] += [rng.randrange(10, vocab) for _ in range(USER_TOKENS)]
            prompt = list(histories[conversation])
            decision = router.choose(RoutedPrompt(prompt))
            routed.append((conversation, prompt, decision, router.begin(decision)))
        for index, engine in enumerate(engines):
            mine = [item for item in routed if item[2].replica.url == urls[index]]
            outputs = engine.generate([prompt for _, prompt, _, _ in mine], params, use_tqdm=False)
            for (conversation, prompt, decision, lease), output in zip(mine, outputs):
                chain = hash_block_chain(prompt, block)
                cacheable = chain[: max_cacheable_blocks(len(prompt), block)]
                predicted = next((i for i, h in enumerate(cacheable) if h not in computed[index]), len(cacheable))
                ideal = min(previous_lengths[conversation] // block, len(cacheable))
                reply = list(output.outputs[0].token_ids)
                # The engine computed the prompt and every reply token but the last (never fed back).
                computed[index].update(hash_block_chain(prompt + reply[:-1], block))
                previous_lengths[conversation] = len(prompt) + len(reply) - 1
                histories[conversation] += reply
                router.observe_cached_tokens(decision, output.num_cached_tokens)
                lease.first_output()
                lease.add_output_tokens(len(reply))
                lease.finish()
                served.append({"replica": index, "prompt_tokens": len(prompt), "hit_tokens": output.num_cached_tokens,
                               "predicted_hit_tokens": predicted * block, "ideal_hit_tokens": ideal * block})
    return served


def _number(value: Cell) -> float:
    assert isinstance(value, (int, float))
    return float(value)


def plot(result: LabResult, axes: Axes) -> None:
    positions = range(len(result.rows))
    axes.bar([p - 0.2 for p in positions], result.column("napkin_hit_rate"), width=0.4, label="napkin hit rate")
    axes.bar([p + 0.2 for p in positions], result.column("hit_rate"), width=0.4, label="engine hit rate")
    axes.plot(list(positions), result.column("busiest_share"), "kD", label="busiest replica's share of requests")
    axes.axhline(1 / result.settings["replicas"], color="gray", linestyle=":", label="even share")
    axes.set_xticks(list(positions), [str(row["policy"]) for row in result.rows])
    axes.set_ylim(0, 1)
    axes.set_ylabel("fraction")
    axes.legend(loc="upper left", fontsize=8)
