"""The quantized-KV gate of benchmarks/quality.py: a paired, exact McNemar test per family, Bonferroni-corrected
across the families, that fails a path only when its loss is beyond chance."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from quality import paired_loss, significant_losses  # noqa: E402


def _pairs(both: int, lost: int, gained: int, neither: int) -> tuple[list[bool], list[bool]]:
    base = [True] * both + [True] * lost + [False] * gained + [False] * neither
    other = [True] * both + [False] * lost + [True] * gained + [False] * neither
    return base, other


def test_only_the_items_that_differ_count_and_p_is_the_binomial_tail():
    test = paired_loss(*_pairs(both=900, lost=7, gained=2, neither=91))
    assert (test["lost"], test["gained"]) == (7, 2)
    assert math.isclose(test["p"], (math.comb(9, 7) + math.comb(9, 8) + math.comb(9, 9)) / 2**9)
    # Items both paths score alike move nothing: the same split among 10 items or among 10,000.
    assert paired_loss(*_pairs(both=9990, lost=7, gained=2, neither=1))["p"] == test["p"]


def test_no_difference_and_a_gain_are_never_a_loss():
    assert paired_loss(*_pairs(both=50, lost=0, gained=0, neither=50))["p"] == 1.0
    assert paired_loss(*_pairs(both=50, lost=0, gained=20, neither=30))["p"] == 1.0
    assert paired_loss(*_pairs(both=50, lost=3, gained=3, neither=44))["p"] > 0.5


def test_a_loss_fails_the_gate_when_it_is_beyond_chance_after_the_correction():
    tests = {f"family{i}": paired_loss(*_pairs(both=990, lost=1, gained=1, neither=8)) for i in range(12)}
    tests["sort"] = paired_loss(*_pairs(both=930, lost=12, gained=0, neither=58))  # p = 2^-12
    assert significant_losses(tests, 0.05) == ["sort"]
    tests["sort"] = paired_loss(*_pairs(both=930, lost=6, gained=1, neither=63))  # p = 8/128: chance
    assert significant_losses(tests, 0.05) == []
    # p = 79/4096 < 0.05 alone, but not below 0.05 / 13 families
    tests["sort"] = paired_loss(*_pairs(both=930, lost=10, gained=2, neither=58))
    assert 0.05 / 13 < tests["sort"]["p"] < 0.05 and significant_losses(tests, 0.05) == []


def test_a_path_that_costs_nothing_fails_at_most_alpha_of_the_time():
    rng = random.Random(0)
    runs, failed = 400, 0
    for _ in range(runs):
        tests = {}
        for family in range(13):  # 1 item in 20 differs, as often a loss as a gain: no real cost
            differs = [rng.random() < 0.05 for _ in range(200)]
            base = [rng.random() < 0.5 if d else rng.random() < 0.9 for d in differs]
            other = [not b if d else b for b, d in zip(base, differs)]
            tests[str(family)] = paired_loss(base, other)
        failed += bool(significant_losses(tests, 0.05))
    assert failed / runs <= 0.05
