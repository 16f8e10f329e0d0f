"""Figures anyone can trace: every benchmark writes its results file with the provenance of the run (source
revision, uncommitted changes, CPU), and every table of figures in docs/ is either rendered from its results file
(scripts/render_doc_tables.py) or says where its figures come from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY / "benchmarks"))
sys.path.insert(0, str(REPOSITORY / "scripts"))
import render_doc_tables  # noqa: E402
from doc_table_format import RESULTS  # noqa: E402
from provenance import write_result  # noqa: E402


def test_every_benchmark_writes_its_results_through_write_result():
    """No benchmark dumps JSON by itself: only provenance.write_result does, and it records the provenance."""
    own_writers = []
    for script in sorted((REPOSITORY / "benchmarks").glob("*.py")):
        if script.name == "provenance.py":
            continue
        text = script.read_text()
        if re.search(r"json\.dump\(|write_text\(json\.dumps", text):
            own_writers.append(script.name)
    assert not own_writers, f"write results through provenance.write_result: {own_writers}"


def test_a_result_records_the_revision_the_dirty_flag_and_the_cpu(tmp_path):
    write_result(tmp_path / "nested" / "result.json", {"rate": 1.5})
    written = json.loads((tmp_path / "nested" / "result.json").read_text())
    assert written["rate"] == 1.5
    provenance = written["provenance"]
    head = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert provenance["git_revision"] == head.stdout.strip()
    assert isinstance(provenance["dirty"], bool)
    if Path("/proc/cpuinfo").is_file():
        cpu = provenance["cpu"]
        assert cpu["family"] and cpu["model"] and cpu["model_name"] and isinstance(cpu["flags"], list)


def test_the_docs_tables_say_what_their_results_files_do():
    problems = render_doc_tables.check(render_doc_tables.DOCS)
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_figure_off_its_file_and_an_unsourced_table(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(render_doc_tables.DOCS / "performance.md", docs)
    assert render_doc_tables.check(docs) == []
    text = (docs / "performance.md").read_text()
    start = text.index("<!-- table logit-error -->")
    figure = re.compile(r"\d+\.\d\d")
    changed = figure.search(text, start)
    assert changed is not None
    (docs / "performance.md").write_text(text[: changed.start()] + "9" + text[changed.start() + 1 :])
    assert any("differs from its results file" in problem for problem in render_doc_tables.check(docs))
    (docs / "new.md").write_text("Measured:\n\n| run | tok/s |\n|---|---:|\n| a | 12.5 |\n")
    assert any("new.md:3" in problem for problem in render_doc_tables.check(docs))


def test_a_table_read_off_a_results_file_holds_only_its_figures(tmp_path):
    """soak.json's first level's completed rate, rounded, is its figure; 31415.9 is no figure of that file."""
    docs = tmp_path / "docs"
    docs.mkdir()
    figure = f"{json.loads((RESULTS / 'soak.json').read_text())['levels'][0]['completed_rps']:.1f}"
    table = "<!-- results: soak.json -->\n| level | completed/s |\n|---|---:|\n| 0.5× | {} |\n"
    (docs / "soak.md").write_text(table.format(figure))
    assert render_doc_tables.check(docs) == []
    (docs / "soak.md").write_text(table.format("31415.9"))
    assert any("figures in no results file" in problem and "31415.9" in problem
               for problem in render_doc_tables.check(docs))
