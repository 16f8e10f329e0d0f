"""The examples of README.md and docs/: found, run, and compared with the output the docs show.

A fenced bash or python block is an example, and says whether the docs test runs it, by the HTML comment on
the line above it (invisible once rendered):

    <!-- example -->                        run by tests/test_docs_examples.py
    <!-- example: not run (REASON) -->      shown only; REASON says why (a 25-minute benchmark, a model that
                                            does not ship with pagoda, an interactive session)

Every bash and python block carries one of the two. A run example may be followed by an `output` block: what
it prints on stdout, compared line by line (trailing spaces ignored), where `...` matches any text (ids,
timestamps). Without one, the example must only succeed.

Shell examples run with bash in a directory that looks like a checkout after `make install`: the repository's
files, and `.venv` the running interpreter's environment. The python examples of one document share one
namespace, in order, as one reader's session would. `localhost:8000` (and `127.0.0.1:8000`) in an example is
the address of the server the test started.

`python tests/doc_examples.py --base-url URL DOC...` prints what each run example of DOC prints now, against
the server at URL: what to paste into an output block after a deliberate change.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

MARKER = re.compile(r"<!--\s*example(?::\s*not run \((?P<reason>.+)\))?\s*-->")
FENCE = re.compile(r"^```(?P<info>\S*)\s*$")
EXAMPLE_LANGUAGES = ("bash", "python")
OUTPUT_LANGUAGE = "output"
DOCUMENTED_SERVER = ("http://localhost:8000", "http://127.0.0.1:8000", "localhost:8000", "127.0.0.1:8000")
SHELL_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    above: str  # the nearest non-blank line above the opening fence
    follows_block: bool  # only blank lines between this block and the one before it


@dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    language: str
    code: str
    run: bool
    reason: str | None  # why it is not run
    expected: str | None  # the output block after it, if any

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc}:{self.line}"


def fenced_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    above, opening, body, after_block = "", None, [], False
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if opening is None:
            if fence:
                opening = (number, fence["info"], above, after_block)
                body = []
            elif line.strip():
                above, after_block = line.strip(), False
            continue
        if fence and not fence["info"]:
            start, info, marker_line, follows = opening
            blocks.append(Block(start, info, "\n".join(body) + "\n", marker_line, follows))
            opening, above, after_block = None, line.strip(), True
        else:
            body.append(line)
    return blocks


def examples_of(doc: Path, text: str | None = None) -> tuple[list[Example], list[str]]:
    """The document's examples, and its problems: an unmarked bash or python block, an output block that
    follows no run example."""
    blocks = fenced_blocks(doc.read_text(encoding="utf-8") if text is None else text)
    examples: list[Example] = []
    problems: list[str] = []
    for index, block in enumerate(blocks):
        where = f"{doc.name}:{block.line}"
        if block.language == OUTPUT_LANGUAGE:
            before = blocks[index - 1] if index else None
            if not (block.follows_block and before and before.language in EXAMPLE_LANGUAGES
                    and MARKER.fullmatch(before.above) and not MARKER.fullmatch(before.above)["reason"]):
                problems.append(f"{where}: an output block that follows no run example")
            continue
        if block.language not in EXAMPLE_LANGUAGES:
            continue
        marker = MARKER.fullmatch(block.above)
        if marker is None:
            problems.append(f"{where}: a {block.language} block without <!-- example --> or "
                            "<!-- example: not run (REASON) --> above it")
            continue
        after = blocks[index + 1] if index + 1 < len(blocks) else None
        expected = after.code if after and after.language == OUTPUT_LANGUAGE and after.follows_block else None
        examples.append(Example(doc, block.line, block.language, block.code, marker["reason"] is None,
                                marker["reason"], expected))
    return examples, problems


def output_matches(expected: str, actual: str) -> bool:
    """Line by line, trailing spaces and blank lines at the end ignored; `...` in expected matches any text."""
    def normal(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.rstrip().splitlines())

    pattern = ".*?".join(re.escape(part) for part in normal(expected).split("..."))
    return re.fullmatch(pattern, normal(actual), flags=re.DOTALL) is not None


def localize(code: str, base_url: str | None) -> str:
    """The example as run: the documented server's address replaced by the live one's."""
    if base_url is None:
        return code
    host_port = base_url.removeprefix("http://")
    for documented in DOCUMENTED_SERVER:
        code = code.replace(documented, base_url if documented.startswith("http") else host_port)
    return code


def make_checkout(directory: Path) -> Path:
    """A directory that looks like the repository after `make install`: its top-level entries, linked, and
    .venv the environment of the interpreter running the tests."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in (".venv", ".git"):
            (directory / entry.name).symlink_to(entry)
    (directory / ".venv").symlink_to(Path(sys.prefix))
    return directory


class Runner:
    """Runs the examples of one document in order: shell ones in `checkout`, python ones in one namespace."""

    def __init__(self, checkout: Path, base_url: str | None) -> None:
        self.checkout = checkout
        self.base_url = base_url
        self.namespace: dict[str, object] = {"__name__": "__doc_example__"}

    def output(self, example: Example) -> str:
        """What the example prints on stdout; an AssertionError, with its stderr, if it fails."""
        code = localize(example.code, self.base_url)
        if example.language == "python":
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                exec(compile(code, example.name, "exec", dont_inherit=True), self.namespace)
            return stdout.getvalue()
        env = {**os.environ, "PATH": f"{self.checkout / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=self.checkout, env=env,
                              capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)
        if done.returncode != 0:
            raise AssertionError(f"{example.name} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout

    def check(self, example: Example) -> None:
        """Runs the example; an AssertionError if it fails or prints other than its output block."""
        actual = self.output(example)
        if example.expected is not None and not output_matches(example.expected, actual):
            raise AssertionError(f"{example.name} printed other than the docs show.\n--- docs:\n{example.expected}"
                                 f"--- printed:\n{actual}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print what each run example of the given documents prints")
    parser.add_argument("docs", nargs="+", type=Path)
    parser.add_argument("--base-url", help="the live server's address (default: none; examples use :8000)")
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for doc in args.docs:
            runner = Runner(make_checkout(Path(scratch) / doc.name), args.base_url)
            for example in examples_of(doc.resolve())[0]:
                if example.run:
                    print(f"=== {example.name}\n{runner.output(example)}", end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
