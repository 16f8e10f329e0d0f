"""Every example of README.md and docs/ runs, and prints what the docs show (tests/doc_examples.py says how
examples are marked). The examples talk to one live server: the built-in model with no flags, as `make serve`
starts it, over loopback HTTP."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from doc_examples import DOCS, REPO, Example, Runner, examples_of, localize, make_checkout, output_matches
from server_fixtures import start_server

DOCS_WITH_RUN_EXAMPLES = [doc for doc in DOCS if any(example.run for example in examples_of(doc)[0])]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("docs-examples"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return make_checkout(tmp_path_factory.mktemp("docs-checkout") / "pagoda")


def test_every_bash_and_python_block_is_marked_run_or_not_run_with_a_reason():
    problems = [problem for doc in DOCS for problem in examples_of(doc)[1]]
    assert not problems, "\n".join(problems)
    assert all(example.reason for doc in DOCS for example in examples_of(doc)[0] if not example.run)


@pytest.mark.parametrize("doc", DOCS_WITH_RUN_EXAMPLES, ids=lambda doc: str(doc.relative_to(REPO)))
def test_the_examples_print_what_the_docs_show(doc, server, checkout):
    runner = Runner(checkout, server.url)
    for example in examples_of(doc)[0]:
        if example.run:
            runner.check(example)


def test_the_readme_shows_output_beside_its_examples():
    examples = [example for example in examples_of(REPO / "README.md")[0] if example.run]
    assert examples
    missing = [example.name for example in examples if example.expected is None]
    assert not missing, f"run examples of the README without an output block: {missing}"


# --------------------------------------------------------------------------------------------------
# The test itself
# --------------------------------------------------------------------------------------------------

DOC = """Intro.

<!-- example -->
```bash
echo "4 + 3 = $((4 + 3))"
```
```output
4 + 3 = 7
```

<!-- example: not run (a 25-minute benchmark) -->
```bash
sleep 1500
```

<!-- example -->
```python
total = 40 + 7
print({"id": "x1", "total": total})
```
```output
{'id': '...', 'total': 47}
```

```bash
echo unmarked
```
"""


def test_the_extractor_reads_markers_reasons_and_output_blocks(tmp_path):
    examples, problems = examples_of(tmp_path / "doc.md", DOC)
    assert [(e.line, e.language, e.run, e.reason) for e in examples] == [
        (4, "bash", True, None), (12, "bash", False, "a 25-minute benchmark"), (17, "python", True, None)]
    assert examples[0].expected == "4 + 3 = 7\n"
    assert examples[1].expected is None
    assert problems == ["doc.md:25: a bash block without <!-- example --> or <!-- example: not run (REASON) --> "
                        "above it"]


def test_an_output_block_after_a_not_run_example_is_a_problem(tmp_path):
    doc = "<!-- example: not run (long) -->\n```bash\nsleep 9\n```\n```output\nnothing\n```\n"
    assert examples_of(tmp_path / "doc.md", doc)[1] == ["doc.md:5: an output block that follows no run example"]


def test_the_run_examples_pass_as_written(tmp_path):
    runner = Runner(make_checkout(tmp_path / "checkout"), None)
    for example in examples_of(tmp_path / "doc.md", DOC)[0]:
        if example.run:
            runner.check(example)


@pytest.mark.parametrize("wrong", ["4 + 3 = 8\n", "4 + 3 = 7\nand more\n", "4 + 3 =\n"])
def test_a_wrong_expected_output_fails_the_check(tmp_path, wrong):
    example = examples_of(tmp_path / "doc.md", DOC)[0][0]
    runner = Runner(make_checkout(tmp_path / "checkout"), None)
    with pytest.raises(AssertionError, match="printed other than the docs show"):
        runner.check(dataclasses.replace(example, expected=wrong))


def test_a_readme_example_against_the_server_fails_on_a_deliberately_wrong_output(server, checkout):
    example = next(e for e in examples_of(REPO / "README.md")[0] if e.run and e.expected and "curl" in e.code)
    Runner(checkout, server.url).check(example)
    wrong = example.expected.replace("pagoda-demo", "another-model")
    assert wrong != example.expected
    with pytest.raises(AssertionError, match="printed other than the docs show"):
        Runner(checkout, server.url).check(dataclasses.replace(example, expected=wrong))


def test_a_failing_example_fails_the_check_with_its_stderr(tmp_path):
    example = Example(tmp_path / "doc.md", 1, "bash", "echo oops >&2; exit 3\n", True, None, None)
    with pytest.raises(AssertionError, match="exited with 3:\noops"):
        Runner(make_checkout(tmp_path / "checkout"), None).check(example)


def test_ellipsis_matches_any_text_and_nothing_else_is_loose():
    assert output_matches('{"id": "...", "n": 1}', '{"id": "chatcmpl-9f2", "n": 1}\n')
    assert output_matches("a  \nb\n\n", "a\nb")
    assert not output_matches('{"id": "...", "n": 1}', '{"id": "chatcmpl-9f2", "n": 2}')
    assert not output_matches("a\nb", "a\nb\nc")


def test_the_documented_server_address_becomes_the_live_one():
    code = "curl localhost:8000/v1/models; OpenAI(base_url='http://localhost:8000/v1')"
    assert localize(code, "http://127.0.0.1:5123") == (
        "curl 127.0.0.1:5123/v1/models; OpenAI(base_url='http://127.0.0.1:5123/v1')")
