"""Serving needs only the runtime dependencies; `pagoda bench` needs the `bench` extra and says so when it is
missing. Each case runs in a fresh interpreter where the extra's modules cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess:
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in modules)  # `import name` now fails
    script = "import sys\n" + blocked + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_the_server_and_the_cli_import_without_the_bench_extra():
    result = run_without(["httpx", "matplotlib"], """
        import pagoda.cli, pagoda.engine_args, pagoda.entrypoints, pagoda.server.launcher
        args = pagoda.cli.build_parser().parse_args(["serve", "--max-num-seqs", "4"])
        assert pagoda.engine_args.engine_config_from(args).scheduler.max_num_seqs == 4
    """)
    assert result.returncode == 0, result.stderr


def test_bench_without_httpx_names_the_extra_to_install():
    result = run_without(["httpx"], """
        import pagoda.cli
        sys.exit(pagoda.cli.main(["bench", "--base-url", "http://127.0.0.1:9", "--concurrency", "1"]))
    """)
    assert result.returncode == 2
    assert "pip install 'pagoda[bench]'" in result.stderr and "httpx" in result.stderr


def test_bench_without_matplotlib_says_so_before_running():
    result = run_without(["matplotlib"], """
        import pagoda.cli
        sys.exit(pagoda.cli.main(["bench", "--base-url", "http://127.0.0.1:9", "--concurrency", "1"]))
    """)
    assert result.returncode == 2
    assert "matplotlib" in result.stderr and "pip install 'pagoda[bench]'" in result.stderr
    assert "--no-plot" in result.stderr
