"""``autoremat.solvers.none``: the plan that recomputes nothing, and its one budget case."""

from __future__ import annotations

import pytest

from autoremat import Graph, InfeasibleBudgetError, solve
from autoremat.cost import no_recompute_plan, unoptimised_peak_bytes
from autoremat.solvers.none import NoneConfig, solve_none


def test_no_recompute_plan_is_the_none_solution():
    g = Graph.chain([100] * 20, [float(i + 1) for i in range(20)])
    plan = solve(g, 10**9, solver="none")
    assert plan.segments == no_recompute_plan(g).segments
    assert solve_none(g, 10**9).segments == plan.segments


def test_binding_none_is_infeasible_with_the_unoptimised_peak():
    g = Graph.chain([100] * 20)
    peak = unoptimised_peak_bytes(g)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_none(g, peak - 1)
    assert err.value.min_budget_bytes == peak and err.value.solver == "none"
    assert solve_none(g, peak).recompute_segments == []


def test_options():
    with pytest.raises(ValueError, match="none: unknown option"):
        solve_none(Graph.chain([1]), 10, config={"thresholds": 3})
    assert NoneConfig.parse(None) == NoneConfig()
