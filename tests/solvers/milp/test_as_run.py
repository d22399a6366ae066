"""``milp`` priced as plans run (``tails``): optimum, bounds and gaps against the brute force.

A small convolutional net captured by fx has replay tails (a recomputed segment ending in
convolutions replays up to them), so most plans cost less as they run than replayed whole: the
brute force prices every plan of the ``milp`` space both ways (:func:`~autoremat.solvers.milp.search.judge`).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("highspy")

from torch import nn  # noqa: E402

import autoremat  # noqa: E402
from autoremat.solvers.milp import optimality_gap, solve_milp  # noqa: E402
from autoremat.solvers.milp.cut_bound import CUTS_BASIS, cut_bound  # noqa: E402
from autoremat.solvers.milp.exact import TAILS_BASIS  # noqa: E402
from autoremat.solvers.milp.search import best_fit, judge  # noqa: E402

from .milp_oracle import space_table  # noqa: E402


class _Net(nn.Module):
    """Four convolutions with ReLUs between them, summed: 8 fx nodes (a convolution ending a
    recomputed segment is its replay's tail, and the narrow ones make recomputation pay)."""

    def __init__(self) -> None:
        super().__init__()
        widths = (3, 16, 4, 16, 4)
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs[:-1]:
            x = torch.relu(conv(x))
        return self.convs[-1](x).sum()


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    g = autoremat.capture(_Net(), (torch.randn(4, 3, 16, 16),), times="flops")
    assert g.meta["mode"] == "fx" and [g.node(v)["kind"] for v in g.nodes].count("conv") == 4
    table = [(*judge(g, plan, tails=True), extra, plan) for _, extra, plan in space_table(g)]
    return g, table  # (peak, extra as it runs, extra replayed whole, plan)


def _best(table, budget: int, col: int) -> float | None:
    fits = [row[col] for row in table if row[0] <= budget]
    return min(fits) if fits else None


def _budgets(table) -> list[int]:
    """Every distinct step peak of the space up to the least that needs no recomputation."""
    peaks = sorted({row[0] for row in table})
    free = min(row[0] for row in table if row[2] == 0)
    return [p for p in peaks if p <= free]


def test_the_brute_force_prices_differ(net):
    """Without tails in play the tests below could not tell the two prices apart."""
    _, table = net
    assert sum(row[1] < row[2] * (1 - 1e-3) for row in table) > len(table) // 2


def test_the_optimum_as_plans_run_is_the_brute_force_one(net):
    """Its plan and bound are the brute force's as plans run, below the optimum replayed whole
    somewhere (so a bound priced whole, the program's or the lattice's without tails, would fail)."""
    g, table = net
    below_whole = False
    for budget in _budgets(table):
        want = _best(table, budget, 1)
        plan = solve_milp(g, budget, config={"tails": True, "time_limit_s": 20})
        o = plan.options
        peak, extra = judge(g, plan, tails=True)
        assert peak <= budget
        assert extra == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert o["tails"] and o["extra_time_as_run_s"] == pytest.approx(extra, rel=1e-9, abs=1e-15)
        assert o["milp_status"] == "optimal" and o["optimum_bound_s"] <= want * (1 + 1e-6) + 1e-15
        if want > 0:
            assert o["milp_bound_basis"] == TAILS_BASIS
        below_whole |= want < _best(table, budget, 2) * (1 - 1e-3)
    assert below_whole


def test_the_separators_bound_holds_as_plans_run(net):
    g, table = net
    positive = False
    for budget in _budgets(table):
        want = _best(table, budget, 1)
        got = cut_bound(g, budget, 10.0).bound_s
        assert got <= want * (1 + 1e-6) + 1e-15
        positive |= got > 0
    assert positive


def test_without_the_lattice_the_bound_is_the_separators_not_the_program(net):
    """``k`` given: no lattice; the program's bound (over whole replays) is not a bound as plans run,
    and its plans have at most ``k`` segments."""
    g, table = net
    for budget in _budgets(table):
        want = _best(table, budget, 1)
        if not want:
            continue
        plan = solve_milp(g, budget, config={"tails": True, "k": 2, "time_limit_s": 20})
        o = plan.options
        assert len(plan.segments) <= 2  # seeds with more (auto's, of 3, at one budget) are left out
        two = _best([row for row in table if len(row[3].segments) <= 2], budget, 1)
        assert judge(g, plan, tails=True)[1] >= two * (1 - 1e-9) and two >= want
        assert o["optimum_bound_s"] <= want * (1 + 1e-6) + 1e-15
        assert o["milp_bound_basis"] == CUTS_BASIS


def test_gap_as_plans_run(net):
    g, table = net
    budget = _budgets(table)[0]
    plan = autoremat.solve(g, budget, solver="dp-approx")
    gap = optimality_gap(g, plan, budget, time_limit_s=20, tails=True)
    assert gap.tails and gap.basis == TAILS_BASIS and gap.proven_optimal
    assert gap.extra_time_s == pytest.approx(judge(g, plan, tails=True)[1])
    assert gap.bound_s == pytest.approx(_best(table, budget, 1), rel=1e-6)
    text = gap.describe(as_run_s=plan.predicted_extra_time_s)
    assert "as it runs (replays to their tails)" in text and "replays priced to their tails" in text
    assert "replaying segments whole" not in text
    whole = optimality_gap(g, plan, budget, time_limit_s=20)
    assert not whole.tails and whole.extra_time_s >= gap.extra_time_s


def test_tails_must_be_a_bool(net):
    g, _ = net
    with pytest.raises(ValueError, match="tails='yes' must be True"):
        solve_milp(g, 10**9, config={"tails": "yes"})
    with pytest.raises(ValueError, match="tails=1 must be True"):
        optimality_gap(g, autoremat.solve(g, 10**9, solver="chen"), 10**9, tails=1)


def test_best_fit_is_the_brute_force_choice(net):
    g, table = net
    plans = [row[3] for row in table]
    budget = _budgets(table)[0]
    for tails, col in ((True, 1), (False, 2)):
        plan, cost = best_fit(g, plans, budget, tails=tails)
        assert cost == pytest.approx(_best(table, budget, col), rel=1e-12) and plan.solver == "milp"
    plan, cost = best_fit(g, plans, budget, tails=True, k=2)
    assert len(plan.segments) <= 2 and cost == pytest.approx(
        _best([row for row in table if len(row[3].segments) <= 2], budget, 1), rel=1e-12)
    assert best_fit(g, plans, min(row[0] for row in table) - 1) == (None, math.inf)
