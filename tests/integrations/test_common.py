"""Shared integration glue: the device budget turned into a step budget."""

from __future__ import annotations

import pytest

from autoremat import Graph
from autoremat.integrations._common import is_percentage, step_budget_bytes
from autoremat.cost import unoptimised_peak_bytes


def test_step_budget_forms() -> None:
    g = Graph.chain([100, 200, 300])
    peak = unoptimised_peak_bytes(g)
    assert step_budget_bytes("50%", g, "cpu", resident_bytes=10**9) == peak // 2
    assert step_budget_bytes(0.5, g, "cpu", resident_bytes=10**9) == peak // 2
    assert step_budget_bytes(5000, g, "cpu", resident_bytes=1000) == 4000
    assert step_budget_bytes("1KiB", g, "cpu", resident_bytes=24) == 1000
    assert step_budget_bytes("auto", g, "cpu", resident_bytes=10**15) > 0  # free memory excludes resident
    with pytest.raises(ValueError, match="resident before a step"):
        step_budget_bytes(1000, g, "cpu", resident_bytes=1000)


def test_is_percentage() -> None:
    assert is_percentage("40%") and is_percentage(0.4)
    assert not is_percentage("4GB") and not is_percentage(4) and not is_percentage("auto")
