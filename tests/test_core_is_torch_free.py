"""The engine's core (`pagoda.engine.core`), its outward API and the config it reads import no torch: in an
interpreter where importing torch raises, every core module imports, and a scheduling round with the KV manager
runs. The same harness fails when a module in the core imports torch, directly or through the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pagoda.engine.core

TESTS = Path(__file__).parent

# argv[1]: the tests' directory; argv[2:]: directories added to the core package's path, so that a module placed
# there counts as a core module.
HARNESS = """
import importlib
import pkgutil
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ImportError(f"torch may not be imported here (asked for {name})")
        return None


sys.meta_path.insert(0, NoTorch())

import pagoda.engine.core as core

core.__path__.extend(sys.argv[2:])
modules = [info.name for info in pkgutil.iter_modules(core.__path__, "pagoda.engine.core.")]
for name in [*modules, "pagoda.engine.api", "pagoda.config"]:
    importlib.import_module(name)

# A scheduling round, driven as the scheduler's own tests drive it (fake sampled tokens, no model).
sys.path.insert(0, sys.argv[1])
from test_scheduler import assert_consistent, make_request, make_scheduler, step

scheduler = make_scheduler(num_blocks=8)
first, second = make_request("first", 9, max_tokens=3), make_request("second", 9, max_tokens=3)
scheduler.add_request(first)
while scheduler.has_unfinished_requests():
    step(scheduler)
    assert_consistent(scheduler)
scheduler.add_request(second)  # the same prompt: its full blocks come from the prefix cache
while scheduler.has_unfinished_requests():
    step(scheduler)
    assert_consistent(scheduler)
kv = scheduler.kv_cache
assert first.output_token_ids == second.output_token_ids == [7, 7, 7], (first.output_token_ids, second.output_token_ids)
assert second.num_cached_tokens == 8 and kv.num_free_blocks == kv.num_blocks
assert not [name for name in sys.modules if name.partition(".")[0] == "torch"]
print("imported:", " ".join(modules))
"""


def run_harness(*extra_core_dirs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HARNESS, str(TESTS), *map(str, extra_core_dirs)],
                          capture_output=True, text=True, timeout=120)


def test_the_core_imports_and_schedules_where_torch_cannot_be_imported():
    result = run_harness()
    assert result.returncode == 0, result.stderr
    imported = result.stdout.split("imported:", 1)[1].split()
    package = Path(pagoda.engine.core.__file__).parent
    core = sorted(path.stem for path in package.glob("*.py") if path.stem != "__init__")
    assert sorted(name.removeprefix("pagoda.engine.core.") for name in imported) == core
    assert {"scheduler", "kv_cache", "request", "queues", "step_budget", "speculative"} <= set(core)


@pytest.mark.parametrize("leak", ["import torch", "import pagoda.model.llama"])
def test_a_core_module_that_imports_torch_fails_the_check(tmp_path, leak):
    (tmp_path / "leaks_torch.py").write_text(f"from pagoda.engine.core.request import Request\n{leak}\n")
    result = run_harness(tmp_path)
    assert result.returncode != 0
    assert "torch may not be imported here (asked for torch)" in result.stderr
    assert "leaks_torch" in result.stderr
