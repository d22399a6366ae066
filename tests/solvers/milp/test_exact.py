"""``autoremat.solvers.milp.exact``: the lattice stage of ``milp`` and ``auto``'s use of it.

``auto`` on small graphs reaches the brute-force optimum of the ``milp`` space (the other
solvers alone often do not); above its node limit it is left as it was.
"""

from __future__ import annotations

import pytest
from _graphs import random_dag

import autoremat
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.solvers.milp import exact

from .milp_oracle import best_within, space_table


@pytest.mark.parametrize("seed", range(6))
def test_auto_reaches_the_optimum_on_small_graphs(seed):
    assert exact.AUTO_MAX_NODES == 120  # the default
    g = random_dag(30 + seed, 5 + seed % 2)
    table = space_table(g)
    peaks = sorted({p for p, _, _ in table if p < unoptimised_peak_bytes(g)})
    for budget in peaks[:: max(1, len(peaks) // 3)][:3]:
        try:
            plan = autoremat.solve(g, budget, solver="auto")
        except autoremat.InfeasibleBudgetError:
            continue  # no other solver fits there: auto has no plan to improve
        sim = simulate(g, plan)
        assert sim.peak_bytes <= budget
        assert sim.extra_time_s == pytest.approx(best_within(table, budget), abs=1e-12), (seed, budget)


def test_auto_leaves_large_graphs_to_the_other_solvers(monkeypatch):
    g = random_dag(33, 6)
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 3)
    budget = int(0.8 * unoptimised_peak_bytes(g))
    assert exact.auto_improve(g, budget, 1.0) is None
    assert autoremat.solve(g, budget, solver="auto").solver != "milp"


def test_auto_does_not_ask_the_lattice_when_turned_off(monkeypatch):
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 0)
    g = random_dag(34, 6)
    assert exact.auto_improve(g, int(0.8 * unoptimised_peak_bytes(g)), 1.0) is None


def test_auto_improve_finds_only_cheaper_plans():
    g = random_dag(34, 6)
    table = space_table(g)
    budget = sorted({p for p, _, _ in table})[2]
    best = best_within(table, budget)
    assert exact.auto_improve(g, budget, best) is None  # nothing recomputes less than the optimum
    plan = exact.auto_improve(g, budget, best * 2 + 1.0)
    assert plan is not None and simulate(g, plan).extra_time_s == pytest.approx(best)
    assert plan.options["milp_bound_basis"] == "exact model"
