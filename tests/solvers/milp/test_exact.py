"""``autoremat.solvers.milp.exact``: the lattice stage of ``milp`` and ``auto``'s use of it.

``auto`` on small graphs reaches the brute-force optimum of the ``milp`` space (the other
solvers alone often do not); above its node limit it is left as it was, but for the least-peak
search where no other solver fits (up to ``AUTO_LEAST_MAX_NODES``).
"""

from __future__ import annotations

import pytest
from _graphs import convolutional, random_dag, with_held_outputs

import autoremat
from autoremat.cost import simulate, unoptimised_peak_bytes
from autoremat.solvers import finalize_plan
from autoremat.solvers.milp import chain as chain_mod
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


def _auto_extra(g, budget, monkeypatch, lattice: bool, chain: bool = False):
    """auto's extra time with the lattice on or off; its chain search (:mod:`autoremat.solvers.milp.chain`,
    tested in ``test_chain.py``) off unless asked, so that these tests see the lattice alone."""
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 120 if lattice else 0)
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", 300 if chain else 0)
    try:
        return simulate(g, autoremat.solve(g, budget, solver="auto")).extra_time_s
    except autoremat.InfeasibleBudgetError:
        return None


def test_auto_asks_the_lattice_where_no_other_solver_fits(monkeypatch, caplog):
    g = random_dag(40, 7)
    best = best_within(space_table(g), 42)
    assert _auto_extra(g, 42, monkeypatch, lattice=False) is None  # every heuristic is over 42 bytes
    with caplog.at_level("INFO", logger="autoremat.solvers"):
        assert _auto_extra(g, 42, monkeypatch, lattice=True) == pytest.approx(best)
    assert "none fits" in caplog.text and "chose milp" in caplog.text


def test_auto_returns_the_optimum_where_the_heuristics_are_far_off_and_is_never_worse(monkeypatch):
    g = random_dag(59, 7)
    table = space_table(g)
    off, on = _auto_extra(g, 58, monkeypatch, False), _auto_extra(g, 58, monkeypatch, True)
    assert off > 1.05 * best_within(table, 58)  # the heuristics: 9 s against an optimum of 4 s
    assert on == pytest.approx(best_within(table, 58))
    for budget in sorted({p for p, _, _ in table if p < unoptimised_peak_bytes(g)})[::3]:
        off, on = _auto_extra(g, budget, monkeypatch, False), _auto_extra(g, budget, monkeypatch, True)
        assert off is None or on <= off + 1e-12, budget


def test_auto_says_why_it_does_not_ask_the_lattice(monkeypatch, caplog):
    g = random_dag(33, 6)
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 3)
    with caplog.at_level("DEBUG", logger="autoremat.solvers.milp"):
        assert exact.auto_improve(g, int(0.8 * unoptimised_peak_bytes(g)), 1.0) is None
    assert "6 nodes > AUTO_MAX_NODES=3" in caplog.text
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 120)
    monkeypatch.setattr(exact, "AUTO_MAX_LOWER_SETS", 2)
    caplog.clear()
    with caplog.at_level("DEBUG", logger="autoremat.solvers.milp"):
        assert exact.auto_improve(random_dag(35, 6), int(0.8 * unoptimised_peak_bytes(g)), 1.0) is None
    assert "more than AUTO_MAX_LOWER_SETS=2 lower sets" in caplog.text


def test_auto_does_not_ask_the_lattice_on_an_op_by_op_block_capture(caplog):
    """Where the lattice would reach below the heuristics (the graph of the test below), marked as
    a module-level graph with its blocks captured op by op it is not searched (no lattice built):
    there it plans single ops, which such a graph's blocks do not let it recompute."""
    g = random_dag(40, 7)
    g.meta["blocks"] = "ops"
    with caplog.at_level("DEBUG", logger="autoremat.solvers.milp"):
        assert exact.auto_least_peak(g) is None
        assert exact.auto_improve(g, 42, float("inf")) is None
    assert g not in exact._lattices
    assert "blocks captured op by op" in caplog.text
    with pytest.raises(autoremat.InfeasibleBudgetError):
        autoremat.solve(g, 42)  # only the lattice's plan fits 42 bytes (see the test above)


def test_auto_on_a_transformers_op_by_op_capture_gets_its_least_budget_without_the_lattice():
    pytest.importorskip("transformers")
    from autoremat.zoo import hf

    ex = hf.example("resnet")
    g = autoremat.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, times="flops")
    assert g.meta["blocks"] == "ops" and len(g) <= exact.AUTO_MAX_NODES
    least = autoremat.solvers.least_budget(g)
    assert least == min(autoremat.solvers.min_budget(g, s) for s in ("blocks", "chen", "dp-approx"))
    assert g not in exact._lattices and g not in exact._auto_least
    assert autoremat.solve(g, "min").predicted_peak_bytes <= least


def test_auto_least_budget_counts_the_lattice_and_solve_meets_it(monkeypatch):
    g = random_dag(40, 7)
    table = space_table(g)
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 0)
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WORK", 0)  # (the chain search's least peak reaches it too)
    heuristics = autoremat.solvers.least_budget(g.copy())
    monkeypatch.setattr(chain_mod, "CHAIN_RESCUE_WORK", 1_000_000)
    assert autoremat.solvers.least_budget(g.copy()) == min(p for p, _, _ in table)
    monkeypatch.setattr(exact, "AUTO_MAX_NODES", 120)
    least = autoremat.solvers.least_budget(g)
    assert least == min(p for p, _, _ in table) < heuristics  # the space's least peak, below the heuristics'
    plan = autoremat.solve(g, "min")
    assert plan.budget_bytes == least and simulate(g, plan).peak_bytes <= least
    with pytest.raises(autoremat.InfeasibleBudgetError) as info:
        autoremat.solve(g, least - 1)
    assert info.value.min_budget_bytes == least


def test_auto_falls_back_to_the_least_peak_plan_when_the_search_does_not_close(monkeypatch):
    g = random_dag(40, 7)
    least = exact.auto_least_peak(g)
    monkeypatch.setattr(exact, "AUTO_WORK", 0)  # the time search stops at once
    plan = exact.auto_improve(g, least, float("inf"))
    assert plan is not None and simulate(g, plan).peak_bytes <= least
    assert exact.auto_improve(g, least - 1, float("inf")) is None


class _Clock:
    """A stand-in for the ``time`` module of the lattice modules: ``monotonic`` advances ``step``
    seconds per call (0: a frozen clock; 1000: a machine so loaded every deadline has passed)."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


def _clocked(monkeypatch, step: float) -> None:
    from autoremat.solvers.milp import cost_to_go, lattice

    for mod in (exact, lattice, cost_to_go):
        monkeypatch.setattr(mod, "time", _Clock(step))


@pytest.mark.parametrize("step", [0.0, 1000.0])
def test_auto_gives_the_same_plan_however_fast_the_clock_runs(monkeypatch, step):
    # a fresh graph each time: the lattice and least-peak caches are per graph
    monkeypatch.setattr(chain_mod, "CHAIN_MAX_NODES", 0)  # the lattice alone
    calm = autoremat.solve(random_dag(59, 7), 58, solver="auto")
    _clocked(monkeypatch, step)
    loaded = autoremat.solve(random_dag(59, 7), 58, solver="auto")
    assert calm.solver == loaded.solver == "milp"  # the lattice's optimum (with a 2 s deadline: none at step 1000)
    assert [(s.nodes, s.recompute) for s in calm.segments] == [(s.nodes, s.recompute) for s in loaded.segments]
    least = exact.auto_least_peak(random_dag(40, 7))
    assert least is not None and least == exact.auto_least_peak(random_dag(40, 7))


def test_a_search_stopped_by_work_stops_at_the_same_label_at_any_clock_and_cache(monkeypatch):
    from autoremat.cost.bitsets import GraphBits
    from autoremat.solvers.kusumoto.families import all_lower_sets
    from autoremat.solvers.milp.lattice import Lattice

    from _graphs import random_network

    g = random_network("chain_skips", 5, 60)
    p = GraphBits(g)
    budget = int(0.5 * unoptimised_peak_bytes(g))

    def run(lat, step):
        _clocked(monkeypatch, step)
        return [(a.status, a.bound, a.labels, a.work, a.seq) for a in
                (lat.least_time(budget, work=40_000), lat.least_peak(work=3_000))]

    cold = run(Lattice(p, all_lower_sets(p, 10**6)), 1000.0)
    assert [r[0] for r in cold] == ["time_limit", "time_limit"]  # stopped by the work, not by the clock
    warm = Lattice(p, all_lower_sets(p, 10**6))
    warm.least_time(int(0.6 * unoptimised_peak_bytes(g)), work=200_000)  # other replays and bounds cached
    assert run(warm, 0.0) == cold


def test_auto_reaches_the_least_peak_search_past_its_node_limit():
    """Issue 28: a 122-node chain with skips, past ``AUTO_MAX_NODES``: chen and dp-approx reach
    159,488 bytes at least, the lattice's least-peak search (``AUTO_LEAST_MAX_NODES``) 143,424.
    Before, ``least_budget(g)`` said 159,488 and ``auto`` had no plan at 143,424."""
    from _graphs import random_network

    g = random_network("chain_skips", 10, 125)
    assert exact.AUTO_MAX_NODES < len(g) <= exact.AUTO_LEAST_MAX_NODES
    heuristics = min(autoremat.solvers.min_budget(g, "chen"), autoremat.solvers.min_budget(g, "dp-approx"))
    least = autoremat.solvers.least_budget(g)
    assert least == exact.auto_least_peak(g) < heuristics
    plan = autoremat.solve(g, least)
    assert simulate(g, plan).peak_bytes <= least and plan.solver == "milp"
    with pytest.raises(autoremat.InfeasibleBudgetError) as info:
        autoremat.solve(g, least - 1)
    assert info.value.min_budget_bytes == least


def test_auto_asks_the_least_peak_search_only_where_nothing_else_fits(monkeypatch):
    from _graphs import random_network

    g = random_network("chain_skips", 10, 125)
    asked = []
    monkeypatch.setattr(exact, "auto_least_peak", lambda graph: asked.append(graph) or None)
    assert exact.auto_improve(g, unoptimised_peak_bytes(g) // 2, 1.0) is None and not asked  # another plan fits
    assert exact.auto_improve(g, unoptimised_peak_bytes(g) // 2, float("inf")) is None and asked == [g]


@pytest.mark.parametrize("seed,share", [(32, 0.6), (73, 0.8), (144, 0.8)])
def test_auto_asks_the_lattice_priced_with_replay_tails(seed: int, share: float):
    """``auto``'s lattice prices a recomputed segment up to its replay tail (as the plan runs);
    ``milp``'s stays the papers' whole replay, over which it proves its bounds. On convolutional
    DAGs of 12 nodes the optimum priced with tails, finalised, recomputes less than the optimum
    priced whole, finalised the same way, and ``auto``'s plan is the former's."""
    g = convolutional(with_held_outputs(random_dag(seed, 12), seed), seed, share=0.9)
    budget = int(share * unoptimised_peak_bytes(g))
    assert exact.lattice_of(g).p.tails is False and exact.lattice_of(g, tails=True).p.tails is True
    times = []
    for tails in (False, True):
        ans = exact.lattice_of(g, tails).least_time(budget)
        times.append(finalize_plan(g, exact._plan(ans), budget, "milp").predicted_extra_time_s)
    assert times[1] < times[0]
    plan = autoremat.solve(g, budget)
    assert plan.predicted_extra_time_s == pytest.approx(times[1])
    assert plan.options["milp_bound_basis"] == exact.TAILS_BASIS  # what its "optimal" is proven in
    assert "optimal (proven in the exact model, replays priced to their tails)" in plan.describe()


def test_of_plans_that_run_alike_auto_keeps_the_one_shorter_replayed_whole():
    """``TAIL_TIE``: at 75 % of the CPU-size U-Net, the plan priced with tails runs as fast as the
    one priced whole (0.3686 us); without the tie-break ``auto`` took another as fast with its
    tails and 1.57x as slow replayed whole, which a forward runs where a tail cannot be vouched for."""
    from autoremat import zoo
    from autoremat.solvers.milp.search import judge

    g = autoremat.capture(*zoo.build("unet", size="small", device="meta"))
    plan = autoremat.solve(g, int(0.75 * unoptimised_peak_bytes(g)))
    assert plan.predicted_extra_time_s > 0
    assert judge(g, plan)[1] == pytest.approx(plan.predicted_extra_time_s)
