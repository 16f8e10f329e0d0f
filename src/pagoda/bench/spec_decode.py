"""Speculative decoding's acceptance over a run, from the server's Prometheus counters (pure: no network).

A server that speculates (vLLM, pagoda) exports four counters under vLLM's names; a run's figures are their
differences between a scrape before it and one after it. Definitions, as vLLM's own log line and its
Prometheus documentation give them (vllm/v1/spec_decode/metrics.py), over that window:

- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts: the tokens one verification of a draft yields,
  counting the token the target model adds after the accepted ones;
- acceptance rate at position i = drafts whose token i was accepted / drafts.

A draft is one request's proposed tokens checked in one step. The counters are the server's, not the
run's: they count every client's requests in the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_TOTALS = (DRAFTS, DRAFT_TOKENS, ACCEPTED)


@dataclass(frozen=True)
class SpecCounters:
    """The four counters at one scrape, summed over their series (model names, engines)."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...] = ()  # index = draft position


def _base_name(sample_name: str) -> str:
    """A counter's samples are `<name>_total`; a server whose text has no TYPE line may name them either way."""
    return sample_name.removesuffix("_total")


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a /metrics text; None when it has no drafts counter or is not Prometheus text."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = _base_name(sample.name)
                if name in _TOTALS:
                    totals[name] = totals.get(name, 0.0) + sample.value
                elif name == ACCEPTED_PER_POS and sample.labels.get("position", "").isdigit():
                    position = int(sample.labels["position"])
                    per_position[position] = per_position.get(position, 0.0) + sample.value
    except (ValueError, TypeError, IndexError):  # not Prometheus text (an HTML page, say): no counters
        return None
    if DRAFTS not in totals:
        return None
    positions = tuple(per_position.get(i, 0.0) for i in range(max(per_position, default=-1) + 1))
    return SpecCounters(totals[DRAFTS], totals.get(DRAFT_TOKENS, 0.0), totals.get(ACCEPTED, 0.0), positions)


def counters_delta(before: SpecCounters, after: SpecCounters) -> SpecCounters | None:
    """after - before; None when a counter went down (the server restarted in between: no window)."""
    width = max(len(before.accepted_per_position), len(after.accepted_per_position))

    def at(values: tuple[float, ...], index: int) -> float:
        return values[index] if index < len(values) else 0.0

    delta = SpecCounters(
        after.num_drafts - before.num_drafts,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        tuple(at(after.accepted_per_position, i) - at(before.accepted_per_position, i) for i in range(width)),
    )
    values = (delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens, *delta.accepted_per_position)
    return None if any(value < 0 for value in values) else delta


def acceptance(window: SpecCounters) -> dict[str, object] | None:
    """The report's figures for one window; None when no draft was checked in it (rates would be 0 / 0)."""
    drafts = round(window.num_drafts)
    if drafts <= 0:
        return None
    draft_tokens, accepted = round(window.num_draft_tokens), round(window.num_accepted_tokens)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "per_position_acceptance_rate": [value / drafts for value in window.accepted_per_position],
    }


def spec_decode_window(before_text: str | None, after_text: str | None) -> dict[str, object] | None:
    """A run's speculative-decoding figures from the /metrics texts scraped around it (None: a scrape
    failed, the server exports no such counters, it restarted, or it checked no draft in the window)."""
    if before_text is None or after_text is None:
        return None
    before, after = parse_spec_counters(before_text), parse_spec_counters(after_text)
    if before is None or after is None:
        return None
    delta = counters_delta(before, after)
    return None if delta is None else acceptance(delta)
