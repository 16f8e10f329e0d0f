"""Prometheus metrics with vLLM's names, so existing dashboards and autoscalers work unchanged."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from pagoda.engine.api import (
    EngineStats,
    ExpertLoadStats,
    KVCacheDescription,
    KVConnectorStats,
    LoRAStats,
    RequestTimeline,
    SpecDecodeStats,
)
from pagoda.kv_transfer_config import DEVICE_MEDIUM
from pagoda.server.activity import RecentActivity

# vLLM's buckets, trimmed: CPU latencies run longer, so the top buckets go further.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's buckets for vllm:request_time_per_output_token_seconds.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector:
    """Reads the engine's own counters and gauges at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        labels = ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", stats.kv_cache_usage),
            ("pagoda:step_threads", "Threads a step runs with now (fewer while another process is busy on a core).",
             stats.step_threads),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], value)
            yield gauge
        yield from self._counters((
            ("vllm:num_preemptions", "Preemptions by recompute.", stats.num_preemptions),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("pagoda:prompt_tokens_computed", "Prompt positions the model ran (a recompute counts again).",
             stats.prompt_tokens_computed),
            ("pagoda:step_thread_changes", "Changes of the threads a step runs with.", stats.step_thread_changes),
        ))
        if stats.kv_connector is not None:
            yield from self._kv_connector(stats.kv_connector)
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode)
        if stats.lora is not None:
            yield _lora_requests_info(stats.lora)
        if stats.experts is not None:
            yield from self._expert_load(stats.experts)
        yield self._iteration_tokens(stats)

    def _iteration_tokens(self, stats: EngineStats) -> HistogramMetricFamily:
        """Steps by tokens computed, counted by the scheduler: Prometheus wants cumulative bucket counts."""
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                       labels=["model_name"])
        # "1.0", as vLLM writes them (prometheus_client leaves floatToGoString unannotated)
        bounds = [*(floatToGoString(bound) for bound in stats.iteration_token_buckets), "+Inf"]  # type: ignore[no-untyped-call]
        counts = stats.iteration_token_counts or (0,) * len(bounds)
        cumulative = [sum(counts[: index + 1]) for index in range(len(counts))]
        family.add_metric([self.model_name], list(zip(bounds, cumulative)), stats.iteration_tokens_sum)
        return family

    def _kv_connector(self, stats: KVConnectorStats) -> Iterator[CounterMetricFamily]:
        """The KV connector's counters (docs/kv-offload.md), present only when one is configured: vLLM's external
        prefix cache and offload transfer counters, and pagoda's per-medium ones."""
        yield from self._counters((
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in external KV stores.",
             stats.external_prefix_cache_queries),
            ("vllm:external_prefix_cache_hits", "Prompt tokens loaded from external KV stores.",
             stats.external_prefix_cache_hits),
            ("pagoda:kv_offload_failed_loads", "Requests whose load failed and which computed the tokens instead.",
             stats.failed_loads),
        ))
        transfer_bytes = CounterMetricFamily("vllm:kv_offload_total_bytes",
                                             "Bytes moved between the KV pool and a tier.",
                                             labels=["model_name", "transfer_type"])
        transfer_time = CounterMetricFamily("vllm:kv_offload_total_time", "Seconds spent moving KV to and from a tier.",
                                            labels=["model_name", "transfer_type"])
        per_medium = {
            name: CounterMetricFamily(f"pagoda:kv_offload_{name}", doc, labels=["model_name", "medium"])
            for name, doc in (("hit_blocks", "Blocks loaded from the tier."),
                              ("hit_tokens", "Tokens loaded from the tier."),
                              ("blocks_saved", "Blocks saved to the tier."),
                              ("failures", "Calls to the tier that failed or ran past the bounded wait."),
                              ("refused_blocks", "Corrupt or mismatched blocks the tier returned, not served."),
                              ("evicted_blocks", "Blocks the tier dropped: evicted, expired or lost."))
        }
        for tier in stats.tiers:
            for direction, moved, seconds in ((f"{tier.medium}_to_{DEVICE_MEDIUM}", tier.bytes_loaded,
                                               tier.load_seconds),
                                              (f"{DEVICE_MEDIUM}_to_{tier.medium}", tier.bytes_saved,
                                               tier.save_seconds)):
                transfer_bytes.add_metric([self.model_name, direction], moved)
                transfer_time.add_metric([self.model_name, direction], seconds)
            for name, family in per_medium.items():
                family.add_metric([self.model_name, tier.medium], getattr(tier, name))
        yield transfer_bytes
        yield transfer_time
        yield from per_medium.values()

    def _expert_load(self, load: ExpertLoadStats) -> Iterator[CounterMetricFamily]:
        """A mixture of experts' load (docs/moe.md): one series per expert and per expert-parallel rank, each summed
        over the sparse layers, so that the series stay as few as the experts."""
        for name, doc, label, values in (
            ("pagoda:moe_expert_tokens", "(token, expert) pairs routed to the expert, over all sparse layers.",
             "expert", load.expert_tokens),
            ("pagoda:moe_rank_tokens", "(token, expert) pairs computed by the expert-parallel rank's experts.",
             "rank", load.rank_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name", label])
            for index, value in enumerate(values):
                family.add_metric([self.model_name, str(index)], value)
            yield family

    def _spec_decode(self, stats: SpecDecodeStats) -> Iterator[CounterMetricFamily]:
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


def _lora_requests_info(lora: LoRAStats) -> GaugeMetricFamily:
    """vLLM's vllm:lora_requests_info: its labels the adapters of the running and waiting requests (names, comma
    separated) and max_lora, its value the time they were read (vLLM sets it to the time of each update)."""
    gauge = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    gauge.add_metric([str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running)], lora.updated)
    return gauge


def cache_config_info(kv_cache: KVCacheDescription) -> dict[str, str]:
    """vllm:cache_config_info's labels, under vLLM's names and spellings (str() of the value): routers read
    block_size to hash prompts as this server does. num_gpu_blocks is the KV pool's size, whatever the device."""
    return {"block_size": str(kv_cache.block_size), "num_gpu_blocks": str(kv_cache.num_blocks),
            "enable_prefix_caching": str(kv_cache.enable_prefix_caching), "cache_dtype": kv_cache.dtype}


class _InfoCollector:
    """An info gauge (value 1) whose labels carry the configuration, as vLLM exports its configs."""

    def __init__(self, name: str, doc: str, labels: Mapping[str, str]) -> None:
        self.name, self.doc, self.labels = name, doc, dict(labels)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(self.name, self.doc, labels=list(self.labels))
        gauge.add_metric(list(self.labels.values()), 1.0)
        yield gauge


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 cache_info: Mapping[str, str] | None = None, max_model_len: int = 1 << 20) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats))
        if cache_info is not None:
            self.registry.register(_InfoCollector("vllm:cache_config_info", "Information of the KV cache config.",
                                                  {"model_name": model_name, **cache_info}))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
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
        # Per sample, from the engine's timeline of it (RequestTimeline), as vLLM observes each request.
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "First scheduling to first token (prefill).", E2E_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token (decode).",
                                     E2E_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "First scheduling to last token (running).", E2E_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "A request's decode time per output token after the first.", TPOT_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of a request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated for a request.", token_buckets)
        self.recent = RecentActivity()  # the same observations, over the last minutes (the web dashboard's)

    def observe_timeline(self, timeline: RequestTimeline) -> None:
        """One finished sample's per-request histograms; a phase it never reached is left out."""
        for histogram, value in ((self.queue_time, timeline.queue_time), (self.prefill_time, timeline.prefill_time),
                                 (self.decode_time, timeline.decode_time),
                                 (self.inference_time, timeline.inference_time),
                                 (self.request_tpot, timeline.time_per_output_token)):
            if value is not None:
                histogram.observe(value)
        self.request_prompt_tokens.observe(timeline.num_prompt_tokens)
        self.request_generation_tokens.observe(timeline.num_output_tokens)

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
