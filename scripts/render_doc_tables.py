"""Renders the figure tables of docs/*.md from their results files in benchmarks/results/.

A rendered table sits between `<!-- table NAME -->` and `<!-- /table -->`, NAME a key of TABLES: the results
files it reads and, per column, a heading and a format. `python scripts/render_doc_tables.py` rewrites each
such table in place from its files; `--check` changes nothing and exits 1 if one differs (the test suite runs
it, so `make test` fails on a table that no longer says what its file does).

Every other table in docs/ that has a digit in its body says, in a comment on the line before it, where its
figures come from, and `--check` holds it to that:

    <!-- one-off: COMMAND -->             measured once, kept in no file; COMMAND measures it again
    <!-- results: FILE.json[, ...] -->    read off those files (under benchmarks/results/): each figure with
                                          decimals must be one of theirs, as is or scaled (SCALES), rounded
    <!-- not measured -->                 settings, limits, definitions: no measurement in it
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
DOCS = REPOSITORY / "docs"
RESULTS = REPOSITORY / "benchmarks" / "results"

BEGIN = re.compile(r"^(?P<indent>\s*)<!-- table (?P<name>[\w-]+) -->$")  # indented inside a list item
END = "<!-- /table -->"
SOURCE = re.compile(r"^<!-- (?P<kind>one-off|results|not measured)(?::\s*(?P<detail>.+?))? -->$")


@dataclass(frozen=True)
class Column:
    heading: str
    numeric: bool = False  # right-aligned


@dataclass(frozen=True)
class Table:
    files: tuple[str, ...]  # under benchmarks/results/
    columns: tuple[Column, ...]
    rows: Callable[[list[dict]], Iterator[tuple[str, ...]]]  # the loaded files -> the body's cells


def render(table: Table) -> list[str]:
    loaded = [json.loads((RESULTS / name).read_text()) for name in table.files]
    lines = [_row([column.heading for column in table.columns]),
             "|" + "|".join("---:" if column.numeric else "---" for column in table.columns) + "|"]
    for cells in table.rows(loaded):
        assert len(cells) == len(table.columns), cells
        lines.append(_row(cells))
    return lines


def _row(cells: Sequence[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


# --- formats ---------------------------------------------------------------------------------------------------


def seconds(value: float) -> str:
    """0.53, 2.1, 12.7: two decimals below a second, one above."""
    return f"{value:.2f}" if value < 1 else f"{value:.1f}"


def two_places(value: float) -> str:
    """1.71, 22.8: two decimals below 10, one above."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio(value: float) -> str:
    return f"{value:.2f}×"


# --- the tables ------------------------------------------------------------------------------------------------

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


VS_LLAMA_BATCH1 = (Column("pagoda vs llama.cpp"), Column("time per output token"),
                   Column("decode speed", numeric=True), Column("TTFT (128 tokens)"))
VS_LLAMA_STREAMS = (Column("pair"), Column("output tok/s"), Column("TTFT p50"), Column("ITL p99"))
STALL = (Column("`--max-step-ms`", numeric=True), Column("out tok/s", numeric=True),
         Column("TTFT p50 / p99 (s)", numeric=True), Column("ITL p50 / p99 / max (s)", numeric=True),
         Column("TPOT p50 / p99 (s)", numeric=True))

TABLES: dict[str, Table] = {
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
    "verify-step": Table(("verify-step.json",), verify_step_columns(), verify_step_rows),
}


# --- the documents ---------------------------------------------------------------------------------------------


def rewrite(text: str, problems: list[str], where: str) -> str:
    """`text` with every rendered table replaced by its rendering; unknown names and unclosed blocks in problems."""
    lines, out, index = text.split("\n"), [], 0
    while index < len(lines):
        line = lines[index]
        out.append(line)
        index += 1
        match = BEGIN.match(line)
        if not match:
            continue
        end = next((i for i in range(index, len(lines)) if lines[i].strip() == END), None)
        if end is None:
            problems.append(f"{where}:{index}: {line} has no {END}")
            continue
        table = TABLES.get(match["name"])
        if table is None:
            problems.append(f"{where}:{index}: no table named {match['name']!r} in scripts/render_doc_tables.py")
            out.extend(lines[index:end])
        else:
            out.extend(match["indent"] + rendered for rendered in render(table))
        index = end
    return "\n".join(out)


def unsourced_tables(text: str, where: str) -> Iterator[str]:
    """Tables with a digit in their body that are neither rendered nor say where their figures come from."""
    lines = text.split("\n")
    rendered = False
    index = 0
    while index < len(lines):
        line = lines[index]
        if BEGIN.match(line):
            rendered = True
        elif line.strip() == END:
            rendered = False
        if not line.lstrip().startswith("|"):  # a table may be indented, inside a list item
            index += 1
            continue
        start = index
        while index < len(lines) and lines[index].lstrip().startswith("|"):
            index += 1
        body = lines[start + 2 : index]
        if rendered or not any(re.search(r"\d", row) for row in body):
            continue
        before = lines[start - 1].strip() if start else ""
        source = SOURCE.match(before)
        if source is None:
            yield f"{where}:{start + 1}: a table of figures with no <!-- table/one-off/results/not measured --> line"
        elif source["kind"] == "results":
            names = [name.strip() for name in (source["detail"] or "").split(",")]
            missing = [name for name in names if not (RESULTS / name).is_file()]
            for name in missing:
                yield f"{where}:{start + 1}: benchmarks/results/{name} does not exist"
            if not missing:
                values = [value for name in names for value in _numbers(json.loads((RESULTS / name).read_text()))]
                unbacked = [figure for row in body for figure in _decimal_figures(row) if not _backed(figure, values)]
                if unbacked:
                    yield (f"{where}:{start + 1}: figures in no results file it names ({', '.join(names)}): "
                           f"{', '.join(unbacked[:10])}")
        elif source["kind"] == "one-off" and not source["detail"]:
            yield f"{where}:{start + 1}: a one-off table must give the command that measures it"


# How a file may hold a table's figure: as is, a fraction shown as a percentage, seconds shown in ms, bytes/s in GB/s.
SCALES = (1.0, 100.0, 1000.0, 1e-9)


def _numbers(value: object) -> Iterator[float]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)


def _decimal_figures(row: str) -> list[str]:
    """The figures with decimals in a table row's cells after the first (the first names the row)."""
    cells = row.strip().strip("|").split("|")[1:]
    return [figure for cell in cells for figure in re.findall(r"\d[\d,]*\.\d+", cell)]


def _backed(figure: str, values: list[float]) -> bool:
    """Whether some value, at some scale of SCALES, rounds to `figure` at the decimals it shows."""
    shown = float(figure.replace(",", ""))
    half_step = 0.5 * 10 ** -len(figure.split(".")[1]) + 1e-9
    return any(abs(value * scale - shown) <= half_step for value in values for scale in SCALES)


def _documents(docs: Path) -> Iterator[tuple[Path, str, str, list[str]]]:
    """(path, its text, its text with every table rendered, the problems found) for each document."""
    for path in sorted(docs.glob("*.md")):
        where = str(path.relative_to(docs.parent))
        text = path.read_text()
        problems = list(unsourced_tables(text, where))
        rendered = rewrite(text, problems, where)
        if rendered != text:
            problems.append(f"{where}: a table differs from its results file (run scripts/render_doc_tables.py)")
        yield path, text, rendered, problems


def check(docs: Path = DOCS) -> list[str]:
    """What is off in the documents under `docs`: tables that differ from their rendering, unsourced tables."""
    return [problem for *_, problems in _documents(docs) for problem in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is off")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
    else:
        problems = []
        for path, text, rendered, found in _documents(DOCS):
            if rendered != text:
                path.write_text(rendered)
                print(f"rendered the tables of {path.relative_to(REPOSITORY)}")
            problems += [problem for problem in found if "differs from its results file" not in problem]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
