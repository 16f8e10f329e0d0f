"""Prometheus metrics with vLLM's names, so existing dashboards and autoscalers work unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.engine.engine import EngineStats
from pagoda.engine.speculative import SpecDecodeStats

# vLLM's buckets, trimmed: CPU latencies run longer, so the top buckets go further.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Reads the engine's own counters and gauges at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        stats = self.stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", stats.kv_cache_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        yield from self._counters((
            ("vllm:num_preemptions", "Preemptions by recompute.", stats.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
        ))
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode)

    def _spec_decode(self, stats: SpecDecodeStats):
        """Speculative decoding's counters, present only when it is configured (as in vLLM)."""
        yield from self._counters((
            ("vllm:spec_decode_num_drafts", "Drafts checked (one request's in one step).", stats.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens checked.", stats.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
        ))
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens accepted, by position in the draft.",
                                           labels=["model_name", "position"])
        for position, value in enumerate(stats.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position


    def _counters(self, specs: tuple[tuple[str, str, float], ...]) -> Iterator[CounterMetricFamily]:
        """One counter family per (name, doc, value), labelled with the model's name."""
        for name, doc, value in specs:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting before the first step.",
                                    E2E_BUCKETS)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
