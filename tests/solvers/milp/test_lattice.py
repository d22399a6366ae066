"""``autoremat.solvers.milp.lattice``: the label-setting search over every lower set is exact.

On seeded random DAGs its least extra time at several budgets and its least peak equal the
brute force over the whole ``milp`` plan space (every lower-set chain, every flag choice,
simulated), and the plan it returns has the simulator's cost. A deadline in the past returns
a lower bound, never a wrong plan.
"""

from __future__ import annotations

import pytest
from _graphs import random_dag

from autoremat.cost import simulate
from autoremat.cost.bitsets import GraphBits
from autoremat.plan import Plan, Segment
from autoremat.solvers.kusumoto.families import all_lower_sets
from autoremat.solvers.milp.lattice import Lattice, lattice_plan_nodes

from .milp_oracle import best_within, space_table


def _plan(seq: list[int], flags: list[bool]) -> Plan:
    return Plan([Segment(tuple(nodes), f) for nodes, f in zip(lattice_plan_nodes(seq), flags)])


@pytest.mark.parametrize("seed", range(12))
def test_equals_the_brute_force(seed):
    g = random_dag(seed, 3 + seed % 5)
    p = GraphBits(g)
    table = space_table(g)
    lattice = Lattice(p, all_lower_sets(p, 10**6))
    peaks = sorted({peak for peak, _, _ in table})
    least = lattice.least_peak()
    assert least.status == "optimal" and least.cost == peaks[0]
    assert simulate(g, _plan(least.seq, least.flags), record=False).peak_bytes == peaks[0]
    for budget in [peaks[0] - 1, *peaks[:: max(1, len(peaks) // 4)]]:
        want = best_within(table, budget)
        got = lattice.least_time(budget)
        if want is None:
            assert got.status == "infeasible" and got.seq is None
            continue
        assert got.status == "optimal" and got.cost == pytest.approx(want, abs=1e-12)
        sim = simulate(g, _plan(got.seq, got.flags), record=False)
        assert sim.peak_bytes <= budget and sim.extra_time_s == pytest.approx(want, abs=1e-12)


def test_an_incumbent_at_the_optimum_is_proven_and_a_deadline_gives_a_bound():
    g = random_dag(9, 7)
    p = GraphBits(g)
    table = space_table(g)
    budget = sorted({peak for peak, _, _ in table})[1]
    want = best_within(table, budget)
    assert want > 0
    lattice = Lattice(p, all_lower_sets(p, 10**6))
    proven = lattice.least_time(budget, incumbent=want)
    assert proven.status == "optimal" and proven.seq is None and proven.bound == want
    stopped = Lattice(p, all_lower_sets(p, 10**6)).least_time(budget, deadline=0.0)
    assert stopped.status == "time_limit" and stopped.seq is None and stopped.bound <= want
    stopped = Lattice(p, all_lower_sets(p, 10**6)).least_peak(deadline=0.0)
    assert stopped.status == "time_limit" and stopped.bound <= min(peak for peak, _, _ in table)


@pytest.mark.parametrize("seed", range(6))
def test_a_given_cost_to_go_is_used_and_one_past_its_work_is_ignored(seed):
    """``least_time(ctg=...)``: the chain search hands its own ``h`` (exact needs, its grid); the
    answer is the brute force's either way, and a table dropped at its work limit means no ``h``."""
    from autoremat.solvers.milp.cost_to_go import CostToGo

    g = random_dag(seed, 3 + seed % 5)
    p = GraphBits(g)
    table = space_table(g)
    budget = sorted({peak for peak, _, _ in table})[:2][-1]
    want = best_within(table, budget)
    lattice = Lattice(p, all_lower_sets(p, 10**6))
    for ctg in (CostToGo(lattice, budget, grid=64, exact_until=float("inf")), CostToGo(lattice, budget, work=0)):
        assert (ctg.table is None) == (ctg.work_limit == 0)
        got = lattice.least_time(budget, ctg=ctg)
        assert got.status == "optimal" and got.cost == pytest.approx(want, abs=1e-12)
    assert lattice._ctg == {}  # the given ones were used: none built
