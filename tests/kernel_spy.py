"""A compiled kernel module behind a counter, so that a test comparing a kernel path with torch can assert the
kernel really ran: without that check, a CPU or a build that quietly falls back to torch compares torch with
itself and passes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

import pagoda.kernels


class _CountingStack:
    """A DecodeStack the spy built: each step it runs is counted as "DecodeStack.forward"."""

    def __init__(self, stack: Any, calls: Counter) -> None:
        self._stack, self._calls = stack, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)

    def forward(self, *args: Any) -> Any:
        self._calls["DecodeStack.forward"] += 1
        return self._stack.forward(*args)


class KernelSpy:
    """Stands in for one target's compiled module: every call of one of its functions is counted by name."""

    def __init__(self, module: Any) -> None:
        assert module is not None, "no compiled module to spy on"
        self._module = module
        self.calls: Counter = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not callable(value):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            result = value(*args, **kwargs)
            return _CountingStack(result, self.calls) if name == "DecodeStack" else result

        return counted

    def total(self, *names: str) -> int:
        """Calls of these functions (all of them, given none)."""
        return sum(self.calls[name] for name in names) if names else sum(self.calls.values())


def spy_on_engine_kernels(monkeypatch: pytest.MonkeyPatch, target: str) -> KernelSpy:
    """Engines built from here on in the test run `target`'s kernels (PAGODA_SIMD_TARGET), through a spy."""
    monkeypatch.setenv(pagoda.kernels.TARGET_ENV, target)
    module = pagoda.kernels.target_kernels(target)
    assert module is not None, f"the CPU runs the {target} target, so its kernels must build"
    spy = KernelSpy(module)
    # The model loader looks cpu_kernels up in pagoda.kernels when it builds a model.
    monkeypatch.setattr(pagoda.kernels, "cpu_kernels", lambda: spy)
    return spy
