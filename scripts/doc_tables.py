"""The figure tables of docs/*.md that scripts/render_doc_tables.py renders: for each, the results files it
reads (under benchmarks/results/) and, per column, a heading and a format. A table's NAME here is the one in its
`<!-- table NAME -->` marker."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields

from doc_table_format import REPOSITORY, RESULTS, Column, Table, joined, per_second, ratio, seconds, two_places
from doc_tables_labs import labs_summary

LOGIT_STEPS = ("prefill", "decode, batch 1")


def logit_error_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """bf16 and int8 from logit_error.json (an AVX-512 host), then int4 from logit_error-int4.json's runs."""
    dense, int4 = loaded
    results = dense["results"] + [r for run in int4["runs"] for r in run["results"] if r["config"] == "int4"]
    models = list(dict.fromkeys(r["model"] for r in dense["results"]))
    for config in ("bf16", "int8", "int4"):
        for model in models:
            steps = {r["step"]: r for r in results if r["model"] == model and r["config"] == config}
            if not steps:
                continue
            errors = [f"{steps[step]['max_abs_error']:.2f} / {steps[step]['mean_abs_error']:.3f}"
                      for step in LOGIT_STEPS]
            yield model, config, *errors, f"{steps['prefill']['fp32_logit_std']:.2f}"


def _pairs(loaded: list[dict], keep: tuple[tuple[str, ...] | None, ...] = ()) -> Iterator[tuple[str, dict, dict]]:
    """(pagoda vs the GGUF type, pagoda's medians over the rounds, llama.cpp's) of each pair, file by file; keep:
    per file, the pairs ("int8:q8_0") to show (None or left out: all)."""
    for index, document in enumerate(loaded):
        wanted = keep[index] if index < len(keep) else None
        for result in document["results"]:
            if wanted is not None and result["pair"] not in wanted:
                continue
            gguf = {"q4_k_m": "Q4_K_M"}.get(result["llama.cpp"], result["llama.cpp"])
            yield f"{result['pagoda']} vs {gguf}", result["median"]["pagoda"], result["median"]["llama.cpp"]


def vs_llama_cpp_batch1_rows(ttft_ratio: bool) -> Callable[[list[dict]], Iterator[tuple[str, ...]]]:
    """Time per output token, decode speed (llama.cpp's TPOT over pagoda's), TTFT (and pagoda's over theirs)."""

    def rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
        for pair, ours, theirs in _pairs(loaded):
            ttft = f"{ours['ttft_p50_s']:.2f} s vs {theirs['ttft_p50_s']:.2f} s"
            if ttft_ratio:
                ttft += f" ({ratio(ours['ttft_p50_s'] / theirs['ttft_p50_s'])})"
            yield (pair, f"{ours['tpot_p50_s'] * 1000:.0f} ms vs {theirs['tpot_p50_s'] * 1000:.0f} ms",
                   ratio(theirs["tpot_p50_s"] / ours["tpot_p50_s"]), ttft)

    return rows


def vs_llama_cpp_streams_rows(*keep: tuple[str, ...] | None) -> Callable[[list[dict]], Iterator[tuple[str, ...]]]:
    """Output tokens/s (and pagoda's over llama.cpp's), TTFT p50, ITL p99."""

    def rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
        for pair, ours, theirs in _pairs(loaded, keep):
            rate, their_rate = ours["output_tokens_per_s"], theirs["output_tokens_per_s"]
            yield (pair, f"{rate:.0f} vs {their_rate:.0f} ({ratio(rate / their_rate)})",
                   f"{seconds(ours['ttft_p50_s'])} s vs {seconds(theirs['ttft_p50_s'])} s",
                   f"{seconds(ours['itl_p99_s'])} s vs {seconds(theirs['itl_p99_s'])} s")

    return rows


def stall_tradeoff_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    from pagoda.config import SchedulerConfig

    default = next(field.default for field in fields(SchedulerConfig) if field.name == "max_step_ms")
    for row in loaded[0]["rows"]:
        cap = row["max_step_ms"]
        label = "0 (no cap)" if cap == 0 else f"{cap:.0f} (default)" if cap == default else f"{cap:.0f}"
        yield (label, f"{row['output_throughput']:.2f}", f"{row['ttft_p50']:.1f} / {row['ttft_p99']:.1f}",
               f"{row['itl_p50']:.2f} / {row['itl_p99']:.2f} / {two_places(row['itl_max'])}",
               f"{row['tpot_p50']:.2f} / {row['tpot_p99']:.2f}")


def verify_step_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Per model, the verify step's time over a plain decode step's, for each (requests, k)."""
    rows = loaded[0]["rows"]
    for model in dict.fromkeys(row["model"] for row in rows):
        yield model, *(f"{row['ratio']:.2f}" for row in rows if row["model"] == model)


def verify_step_columns() -> tuple[Column, ...]:
    shapes = dict.fromkeys((row["requests"], row["k"]) for row in
                           json.loads((RESULTS / "verify-step.json").read_text())["rows"])
    return (Column("model"), *(Column(f"{requests} x (1 + {k})", numeric=True) for requests, k in shapes))


def speculative_candidates_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Per (k, first-token candidates): acceptance at each draft position (accepted there / drafts), overall,
    tokens a step, the measured speed-up and the one `pagoda calc` predicts from them."""
    for row in loaded[0]["rows"]:
        k = str(row["k"]) if row["workload"] == "bench" else f"{row['k']}, random prompts"
        positions = ", ".join(f"{accepted / row['num_drafts']:.2f}" for accepted in row["accepted_per_position"])
        predicted = f"{row['predicted']:.2f}x" if "predicted" in row else ""
        yield (k, str(row["first_token_candidates"]), positions, f"{row['acceptance']:.2f}",
               f"{row['mean_accepted_length']:.2f}", f"{row['speedup']:.2f}x", predicted)


def prefix_cache_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Caching on against off: latencies, rates, wall time, and the prompt tokens the cache served."""
    result = loaded[0]
    on, off = result["caching_on"], result["caching_off"]
    # the figure with a target: (the target's key in the file, how the table states it, whether it was met)
    targets = {"ttft_p50_s": ("ttft_p50_on_over_off_at_most", "≤", "ttft"),
               "total_tokens_per_s": ("total_throughput_on_over_off_at_least", "≥", "throughput")}

    def compared(key: str, unit: str, digits: int, label: str) -> tuple[str, ...]:
        ratio_text = f"{on[key] / off[key]:.2f}"
        if key in targets:
            bound, sign, met = targets[key]
            verdict = "met" if result["targets_met"][met] else "missed"
            ratio_text = f"**{ratio_text}** (target {sign} {result['targets'][bound]:g}: {verdict})"
        return label, f"{on[key]:,.{digits}f}{unit}", f"{off[key]:,.{digits}f}{unit}", ratio_text

    yield compared("ttft_p50_s", " s", 2, "TTFT p50")
    yield compared("ttft_p90_s", " s", 2, "TTFT p90")
    yield compared("e2e_p50_s", " s", 2, "E2E latency p50")
    yield compared("total_tokens_per_s", "", 0, "total throughput (prompt + output tokens/s)")
    yield compared("output_tokens_per_s", "", 1, "output tokens/s")
    yield compared("duration_s", " s", 1, f"wall time for the {result['workload']['num_requests']} requests")
    yield ("prompt tokens served from the cache", f"{on['cached_tokens']:,} of {on['prompt_tokens']:,}",
           f"{off['cached_tokens']:,}", "")


def decode_targets_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Per config: decode tokens per CPU-second through torch and through the kernels, at batch 1 and 32, and
    the kernels' over torch's."""
    results = loaded[0]["results"]
    for config in dict.fromkeys(r["config"] for r in results):
        rate = {(r["path"], r["batch"]): r["decode_tokens_per_s"] for r in results if r["config"] == config}
        kernels = next(path for path, _ in rate if path != "torch")
        activations = {"float32": "fp32", "bfloat16": "bf16"}
        dtype = next(r["dtype"] for r in results if r["config"] == config)
        label = f"{config} ({activations[dtype]} activations)" if config.startswith("int") else config
        cells = []
        for batch in (1, 32):
            torch_rate, kernel_rate = rate["torch", batch], rate[kernels, batch]
            cells += [f"{torch_rate:.1f}", f"{kernel_rate:.1f} ({ratio(kernel_rate / torch_rate)})"]
        yield label, *cells


QUALITY_PATHS = {"transformers": "transformers fp32", "fp32": "pagoda fp32", "bf16": "pagoda bf16",
                 "int8": "pagoda int8 (W8A16)", "fp32+ngram": "fp32 + n-gram drafts",
                 "fp32+draft": "fp32 + int8 draft model"}
PASSING_ACCURACY = 90.0  # a family at or above it is in bold: what the demo model is good at


def quality_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Held-out exact match per family and path, the mean, and how many greedy outputs equal transformers'."""
    paths = loaded[0]["paths"]
    for family in paths["transformers"]["accuracy"]:
        cells = []
        for path in QUALITY_PATHS:
            accuracy = paths[path]["accuracy"][family]
            cell = f"{accuracy:.1f}%"
            cells.append(f"**{cell}**" if family != "mean" and accuracy >= PASSING_ACCURACY else cell)
        yield family, *cells
    yield ("greedy outputs identical to transformers",
           *(f"{paths[path]['agreement']['identical']}/{paths[path]['agreement']['items']}"
             if "agreement" in paths[path] else "" for path in QUALITY_PATHS))


def speculative_rows(labels: dict[tuple[str, str], str],
                     batch_labels: dict[str, str] | None = None) -> Callable[[list[dict]], Iterator[tuple[str, ...]]]:
    """One row per workload at batch 1 (sections a-c of benchmarks/speculative.py), its k side by side: speed-up,
    acceptance, tokens a step. labels: (section, workload) -> the row's name. batch_labels: also one row per
    workload of the batch-size sweep (section d, batches above 1), named batch_labels[workload].format(sizes)."""

    def method(row: dict) -> str:
        if row["method"] != "ngram":
            return row["method"]
        sys.path.insert(0, str(REPOSITORY / "benchmarks"))
        from speculative import NGRAM

        return f"ngram {NGRAM['prompt_lookup_min']}-{NGRAM['prompt_lookup_max']}"

    def summarized(rows: list[dict], name: str) -> tuple[str, ...]:
        return (name, method(rows[0]), joined([str(row["k"]) for row in rows]),
                joined([f"{row['speedup']:.2f}x" for row in rows]),
                joined([f"{row['acceptance']:.2f}" for row in rows]),
                joined([f"{row['mean_accepted_length']:.2f}" for row in rows]))

    def rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
        results = loaded[0]["rows"]
        for (section, workload), name in labels.items():
            yield summarized([r for r in results if (r["section"], r["workload"], r["batch_size"]) ==
                              (section, workload, 1)], name)
        if batch_labels is None:
            return
        sweep = [r for r in results if r["section"] == "d" and r["batch_size"] > 1]
        for workload in dict.fromkeys(r["workload"] for r in sweep):
            group = [r for r in sweep if r["workload"] == workload]
            sizes = " / ".join(str(r["batch_size"]) for r in group)
            yield summarized(group, batch_labels[workload].format(sizes=sizes))

    return rows


def structured_output_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """A decode step with and without a grammar at each batch size, and the TTFT a cached grammar adds."""
    result = loaded[0]
    step_bound = f"≤ +{result['targets']['decode_overhead_at_most']:.0%}"
    for row in result["decode"]:
        yield (f"decode step, batch {row['batch']}", f"{row['unconstrained_step_s'] * 1000:.1f} ms",
               f"{row['constrained_step_s'] * 1000:.1f} ms ({row['overhead']:+.1%})".replace("-", "−"), step_bound)
    ttft = result["ttft"]
    yield (f"TTFT with a cached grammar, median of {len(ttft['cases'])} constraints",
           f"{ttft['median_unconstrained_s'] * 1000:.1f} ms", f"+{ttft['median_added_s'] * 1000:.2f} ms",
           f"≤ +{result['targets']['ttft_added_ms_at_most']:g} ms")


def router_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Per policy: the replicas' prefix hit rate, TTFT, throughput (and over round robin's), requests per replica."""
    for row in loaded[0]["results"]:
        served = " / ".join(f"{count:.0f}" for count in row["served_per_replica"])
        yield (row["policy"], f"{row['hit_rate']:.2f}", f"{row['ttft_p50_s']:.1f} s", f"{row['ttft_p99_s']:.1f} s",
               f"{row['total_throughput']:.1f}", f"{row['throughput_vs_round_robin']:.2f}", served)


def bench_sweep_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """One `pagoda bench` sweep's levels: requests, output rate, TTFT, TPOT and E2E percentiles."""
    for point in loaded[0]["endpoints"][0]["levels"]:
        summary = point["summary"]
        ttft, tpot = summary["ttft"], summary["tpot"]
        yield (f"{point['level']:g}", str(summary["num_requests"]), f"{summary['output_throughput']:.1f}",
               f"{two_places(ttft['p50'])} / {two_places(ttft['p99'])}",
               f"{tpot['p50'] * 1000:.0f} / {tpot['p99'] * 1000:.0f}", f"{summary['e2e']['p50']:.1f}")


# A decode step whose read ran at least this fast ran on a fast host: the shared host's streaming read is bimodal
# (~34 GB/s at times, ~55 at others), and batch-1 decode follows it.
FAST_HOST_READ = 45e9


def roofline_rows(loaded: list[dict]) -> Iterator[tuple[str, ...]]:
    """Per workload and model, each config's fraction of its floor and rate (in bold for the workload's first model,
    the headline); batch-1 decode of the first decode model also split into its steps on a fast host and on a
    slow one."""
    document = loaded[0]
    settings, results = document["config"], document["results"]
    configs = settings["configs"].split(",")
    labels = {"decode": f"decode, batch 1, {settings['prompt_len']} → +{settings['decode_tokens']}",
              "prefill": f"prefill, {settings['prefill_tokens']:,} tokens",
              "offline": f"offline {settings['offline_prompts']} × {settings['prompt_len']} → "
                         f"{settings['offline_tokens']}"}
    units = {"decode": "tok/s", "prefill": "tok/s", "offline": "out tok/s"}
    headline = {}
    for result in results:
        headline.setdefault(result["kind"], result["model"])
    for kind, model in dict.fromkeys((r["kind"], r["model"]) for r in results):
        row = {r["config"]: r for r in results if (r["kind"], r["model"]) == (kind, model)}
        cells = []
        for index, config in enumerate(configs):
            fraction = f"{row[config]['fraction']:.2f}"
            rate = per_second(row[config]["tokens_per_s"]) + (f" {units[kind]}" if index == 0 else "")
            cells.append(f"{f'**{fraction}**' if headline[kind] == model else fraction} ({rate})")
        targets = {config: row[config]["target"] for config in configs if row[config]["target"]}
        if len(set(targets.values())) > 1:
            first = configs[0]
            target = f"{first} ≥ {targets[first]:g}, others ≥ {min(targets.values()):g}"
        else:
            target = f"≥ {next(iter(targets.values())):g}" if targets else ""
        yield labels[kind], model, *cells, target
        if kind == "decode" and model == headline[kind]:
            for host, fast in (("fast", True), ("slow", False)):
                split = []
                for index, config in enumerate(configs):
                    steps = [(fraction, seconds) for run in row[config]["runs"]
                             for read, fraction, seconds in zip(run["step_read_bytes_per_s"], run["step_fraction"],
                                                                run["decode_step_s"])
                             if (read >= FAST_HOST_READ) == fast]
                    total = sum(len(run["decode_step_s"]) for run in row[config]["runs"])
                    fraction = statistics.median(fraction for fraction, _ in steps)
                    rate = 1 / statistics.median(seconds for _, seconds in steps)
                    counted = f"{len(steps)} of {total} steps" if index == 0 else str(len(steps))
                    unit = " tok/s" if index == 0 else ""
                    split.append(f"{fraction:.2f} ({rate:.1f}{unit}; {counted})")
                yield f"— its steps on a {host} host", model, *split, ""


SPECULATIVE = (Column("workload"), Column("method"), Column("k"), Column("speed-up"), Column("acceptance"),
               Column("tokens / step"))

VS_LLAMA_BATCH1 = (Column("pagoda vs llama.cpp"), Column("time per output token"),
                   Column("decode speed", numeric=True), Column("TTFT (128 tokens)"))
VS_LLAMA_STREAMS = (Column("pair"), Column("output tok/s"), Column("TTFT p50"), Column("ITL p99"))
STALL = (Column("`--max-step-ms`", numeric=True), Column("out tok/s", numeric=True),
         Column("TTFT p50 / p99 (s)", numeric=True), Column("ITL p50 / p99 / max (s)", numeric=True),
         Column("TPOT p50 / p99 (s)", numeric=True))

TABLES: dict[str, Table] = {
    "labs-builtin": labs_summary(""),
    "labs-bench-125m": labs_summary("bench-125m"),
    "logit-error": Table(
        ("logit_error.json", "logit_error-int4.json"),
        (Column("model"), Column("path"), Column("prefill: max / mean abs error", numeric=True),
         Column("batch-1 decode: max / mean", numeric=True), Column("fp32 logits' std", numeric=True)),
        logit_error_rows),
    "vs-llama-cpp-batch1-bench-1b": Table(("vs-llama-cpp-batch1-bench-1b.json",), VS_LLAMA_BATCH1,
                                          vs_llama_cpp_batch1_rows(ttft_ratio=False)),
    "vs-llama-cpp-batch1-bench-1b-xeon": Table(
        ("vs-llama-cpp-batch1-bench-1b-xeon.json", "vs-llama-cpp-batch1-bench-1b-xeon-quantized.json"),
        VS_LLAMA_BATCH1, vs_llama_cpp_batch1_rows(ttft_ratio=True)),
    "vs-llama-cpp-streams-bench-125m-quantized": Table(
        ("vs-llama-cpp-streams-bench-125m-quantized.json",), (Column("pagoda vs llama.cpp"), *VS_LLAMA_STREAMS[1:]),
        vs_llama_cpp_streams_rows()),
    # fp32 from the first run; int8 and int4 from the later one, through the AVX2 integer matmuls
    "vs-llama-cpp-streams-bench-125m": Table(
        ("vs-llama-cpp-streams-bench-125m.json", "vs-llama-cpp-streams-bench-125m-quantized.json"),
        VS_LLAMA_STREAMS, vs_llama_cpp_streams_rows(("fp32:f32",))),
    "vs-llama-cpp-streams-bench-125m-xeon": Table(
        ("vs-llama-cpp-streams-bench-125m-xeon.json", "vs-llama-cpp-streams-bench-125m-xeon-quantized.json"),
        VS_LLAMA_STREAMS, vs_llama_cpp_streams_rows()),
    "stall-tradeoff": Table(("stall_tradeoff.json",), STALL, stall_tradeoff_rows),
    "stall-tradeoff-repeat": Table(("stall_tradeoff_repeat.json",), STALL, stall_tradeoff_rows),
    "speculative-candidates-bench-1b-xeon": Table(
        ("speculative-bench-1b-xeon.json",),
        (Column("k"), Column("c"), Column("accepted at position 0, 1"), Column("acceptance"),
         Column("tokens / step"), Column("speed-up"), Column("predicted")),
        speculative_candidates_rows),
    "prefix-cache": Table(("prefix_cache.json",),
                          (Column(""), Column("caching on", numeric=True), Column("caching off", numeric=True),
                           Column("on / off", numeric=True)),
                          prefix_cache_rows),
    "decode-targets-avx2": Table(
        ("decode-targets-avx2-cpu-time.json",),
        (Column("config"), Column("torch, batch 1", numeric=True), Column("avx2, batch 1", numeric=True),
         Column("torch, batch 32", numeric=True), Column("avx2, batch 32", numeric=True)),
        decode_targets_rows),
    "quality": Table(("quality.json",),
                     (Column("family"), *(Column(heading, numeric=True) for heading in QUALITY_PATHS.values())),
                     quality_rows),
    "speculative": Table(("speculative.json",), SPECULATIVE, speculative_rows({
        ("a", "copy"): "demo model, `copy` prompts", ("a", "json"): "demo model, `json` prompts",
        ("a", "reverse"): "demo model, `reverse` (answer = prompt backwards)",
        ("c", "random"): "demo model, random prompts, sampled",
        ("b", "bench"): "bench-125m fp32, its int8 copy drafting (bf16)",
        ("c", "bench-random"): "bench-125m, random prompts"})),
    "speculative-xeon": Table(("speculative-xeon.json",), SPECULATIVE, speculative_rows({
        ("a", "copy"): "`copy` prompts", ("a", "json"): "`json` prompts", ("a", "reverse"): "`reverse`",
        ("c", "random"): "random prompts, sampled"},
        batch_labels={"copy": "batch {sizes}, `copy`", "random": "batch {sizes}, random"})),
    "structured-output": Table(("structured_output.json",),
                               (Column("what"), Column("unconstrained", numeric=True),
                                Column("constrained", numeric=True), Column("target")),
                               structured_output_rows),
    "router": Table(("router.json",),
                    (Column("policy"), Column("prefix hit rate"), Column("TTFT p50"), Column("TTFT p99"),
                     Column("total tok/s"), Column("vs round_robin"), Column("served")),
                    router_rows),
    "bench-sweep-125m": Table(("sweep-bench-125m.json",),
                              (Column("concurrency", numeric=True), Column("requests", numeric=True),
                               Column("output tok/s", numeric=True), Column("TTFT p50 / p99 (s)", numeric=True),
                               Column("TPOT p50 / p99 (ms)", numeric=True), Column("E2E p50 (s)", numeric=True)),
                              bench_sweep_rows),
    "roofline": Table(("roofline.json",),
                      (Column("workload"), Column("model"), Column("fp32", numeric=True), Column("bf16", numeric=True),
                       Column("int8", numeric=True), Column("target")),
                      roofline_rows),
    "verify-step": Table(("verify-step.json",), verify_step_columns(), verify_step_rows),
}
