"""The per-region knapsack that picks which op outputs a recomputed region keeps."""

from __future__ import annotations

import itertools
import random

import pytest

from autoremat.solvers.selective_saves import choose_saves, region_policies


def _brute(costs: list[tuple[int, float]], allowance: int) -> float:
    best = 0.0
    for r in range(len(costs) + 1):
        for combo in itertools.combinations(range(len(costs)), r):
            if sum(costs[i][0] for i in combo) <= allowance:
                best = max(best, sum(costs[i][1] for i in combo))
    return best


def test_golden_cases() -> None:
    assert choose_saves([], 100) == []
    assert choose_saves([(10, 1.0)], 0) == []
    assert choose_saves([(10, 1.0), (0, 5.0)], 10) == [0]  # a view (no bytes) is never an item
    # the one big slow op beats two small fast ones, and everything fits when the allowance is large
    assert choose_saves([(60, 5.0), (50, 2.0), (50, 2.0)], 100) == [0]
    assert choose_saves([(60, 5.0), (50, 2.0), (50, 2.0)], 1000) == [0, 1, 2]


def test_equals_brute_force_with_unit_one() -> None:
    rng = random.Random(0)
    for _ in range(200):
        costs = [(rng.randint(1, 40), rng.random()) for _ in range(rng.randint(0, 7))]
        allowance = rng.randint(0, 100)
        kept = choose_saves(costs, allowance, unit_bytes=1)
        assert sum(costs[i][0] for i in kept) <= allowance
        assert sum(costs[i][1] for i in kept) == pytest.approx(_brute(costs, allowance))


def test_quantised_never_exceeds_and_grows_with_allowance() -> None:
    rng = random.Random(1)
    costs = [(rng.randint(1_000, 90_000), rng.random()) for _ in range(30)]
    last = -1.0
    for allowance in range(0, 600_000, 50_000):
        kept = choose_saves(costs, allowance)
        assert sum(costs[i][0] for i in kept) <= allowance
        gain = sum(costs[i][1] for i in kept)
        assert gain >= last - 1e-12 or allowance == 0
        last = gain


def test_region_policies_split_the_allowance() -> None:
    costs = {"a": [(60, 1.0), (40, 0.5)], "b": [(60, 1.0)]}
    kept = region_policies(costs, 120)
    assert kept == {"a": [0], "b": [0]}
    assert region_policies({}, 100) == {}
    assert region_policies(costs, -5) == {"a": [], "b": []}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="allowance_bytes"):
        choose_saves([(1, 1.0)], -1)
    with pytest.raises(ValueError, match="unit_bytes"):
        choose_saves([(1, 1.0)], 10, unit_bytes=0)
    with pytest.raises(ValueError, match="non-negative"):
        choose_saves([(-1, 1.0)], 10)


def test_identical_regions_share_one_answer() -> None:
    """Two identical layers whose measured times differ by noise get the same kept ops, chosen on
    the median times; a different layer is solved on its own."""
    costs = {"l0": [(50, 1.0), (50, 0.9)], "l1": [(50, 0.8), (50, 1.1)], "l2": [(50, 0.8), (50, 1.1)],
             "other": [(30, 1.0), (70, 2.0)]}
    kept = region_policies(costs, 4 * 50)
    assert kept["l0"] == kept["l1"] == kept["l2"] == [1]  # medians 0.8 vs 1.0: the second op
    assert kept["other"] == [0]  # 50 bytes per region: only the 30-byte op fits
