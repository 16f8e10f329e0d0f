"""Renders the figure tables of docs/*.md from their results files in benchmarks/results/.

A rendered table sits between `<!-- table NAME -->` and `<!-- /table -->`, NAME a key of doc_tables.TABLES:
the results files it reads and, per column, a heading and a format. `python scripts/render_doc_tables.py` rewrites each
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
from collections.abc import Iterator, Sequence
from pathlib import Path

from doc_table_format import REPOSITORY, RESULTS, Table
from doc_tables import TABLES

DOCS = REPOSITORY / "docs"

BEGIN = re.compile(r"^(?P<indent>\s*)<!-- table (?P<name>[\w-]+) -->$")  # indented inside a list item
END = "<!-- /table -->"
SOURCE = re.compile(r"^<!-- (?P<kind>one-off|results|not measured)(?::\s*(?P<detail>.+?))? -->$")


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
            problems.append(f"{where}:{index}: no table named {match['name']!r} in scripts/doc_tables.py")
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


SERIES = 16  # a list longer than this is a series of raw samples (per step, per request), not a summary


def _numbers(value: object) -> Iterator[float]:
    """The numbers in a results file, less its series: a table shows summaries, and thousands of samples would
    let almost any figure pass for one of them."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list) and len(value) <= SERIES:
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
    # The figure's digits, not its sign: a table writes a negative as a minus before them.
    return any(abs(abs(value) * scale - shown) <= half_step for value in values for scale in SCALES)


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
