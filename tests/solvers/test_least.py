"""``budget="min"`` and the reachable range (autoremat.solvers.least, autoremat.budget)."""

from __future__ import annotations

import pytest

from autoremat import Graph, InfeasibleBudgetError, min_budget, simulate, solve
from autoremat.budget import check_budget, check_on_infeasible, is_min, parse_budget, reachable_range_text
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers import least_budget


def _skip_chain(n: int = 24) -> Graph:
    edges = [(v - 1, v) for v in range(1, n)] + [(v - 3, v) for v in range(3, n, 3)]
    return Graph.from_edges(n, edges, out_bytes=[100 + (v * 37) % 400 for v in range(n)],
                            time_s=[10.0 if v % 3 == 1 else 1.0 for v in range(n)])


@pytest.mark.parametrize("solver", ["chen", "dp-approx", "xla-greedy", "none"])
def test_min_is_the_named_solvers_least_budget(solver: str) -> None:
    g = _skip_chain()
    plan = solve(g, "min", solver=solver)
    assert plan.budget_bytes == min_budget(g, solver) == least_budget(g, solver)
    assert simulate(g, plan).peak_bytes <= plan.budget_bytes


def test_auto_min_is_the_least_of_the_solvers_auto_tries() -> None:
    g = _skip_chain()
    least = least_budget(g)
    assert least <= min(min_budget(g, "chen"), min_budget(g, "dp-approx"))  # the lattice may reach lower
    plan = solve(g, " MIN ")
    assert plan.budget_bytes == least and simulate(g, plan).peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, least - 1)
    assert info.value.min_budget_bytes == least


def test_infeasible_error_states_the_range_in_bytes_and_percent() -> None:
    g = _skip_chain()
    peak, least = unoptimised_peak_bytes(g), least_budget(g, "chen")
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(g, "10%", solver="chen")
    err = info.value
    assert err.unoptimised_peak_bytes == peak and err.min_budget_bytes == least
    msg = str(err)
    assert f"{100 * least / peak:.0f} % of the unoptimised step peak" in msg
    assert f"({int(peak * 0.1)} bytes, 10 %)" in msg
    assert "budget='min'" in msg and "on_infeasible='min'" in msg


def test_budget_words() -> None:
    assert is_min("min") and is_min(" Min ") and not is_min("auto") and not is_min(5)
    for ok in ("min", "auto", "50%", 0.5, 10, "6GB"):
        check_budget(ok)
    with pytest.raises(ValueError, match="minimum"):
        check_budget("minimum")
    with pytest.raises(ValueError, match="give it to autoremat.solve"):
        parse_budget("min")
    assert check_on_infeasible("MIN") == "min"
    with pytest.raises(ValueError, match="on_infeasible='fallback' must be 'error'"):
        check_on_infeasible("fallback")
    assert reachable_range_text(512, 1024) == "512 B (50 %) to 1.00 KiB (100 %, no recomputation)"


def test_min_on_a_model_whose_gradients_dominate() -> None:
    """The README's MLP case: 50 % is not reachable, "min" is, and says how far it gets."""
    import autoremat

    model, inputs = autoremat.zoo.build("mlp", size="small")
    g = autoremat.capture(model, inputs, times="flops")
    with pytest.raises(InfeasibleBudgetError, match="plans reach"):
        solve(g, "50%")
    plan = solve(g, "min")
    assert plan.budget_bytes == least_budget(g) <= unoptimised_peak_bytes(g)
