"""``autoremat.solvers.polish``: the hill climb on a plan's segment boundaries that ``auto`` runs
last (issue 28: ``auto`` 1.06-1.24x the best known plan on seeded random U-Nets at 50 %)."""

from __future__ import annotations

import pytest

import autoremat
import autoremat.solvers as solvers_pkg
from autoremat.cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from autoremat.solvers import polish as polish_mod
from autoremat.solvers.polish import POLISH_MAX_NODES, _moves, polish

from _graphs import random_network


def _unet():
    return random_network("unet", 73, 95)


def _extra(g, plan) -> float:
    return simulate(g, plan, check=False, record=False).extra_time_s


def test_polish_recomputes_less_than_dp_approx_on_a_unet_and_auto_takes_it():
    g = _unet()
    budget = int(0.5 * unoptimised_peak_bytes(g))
    dp = autoremat.solve(g, budget, solver="dp-approx")
    found = polish(g, dp, budget)
    assert found is not None and found.options["polished_moves"] >= 1
    sim = simulate(g, found, check=False, record=False)
    assert sim.peak_bytes <= budget and sim.extra_time_s < 0.95 * _extra(g, dp)
    plan = autoremat.solve(g, budget)  # auto: the polished plan, finalised (fits with its replay tails)
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_extra_time_s <= sim.extra_time_s * (1 + 1e-9) < dp.predicted_extra_time_s


@pytest.mark.parametrize("family", ["chain_skips", "unet", "dense", "transformer"])
def test_a_polished_plan_fits_and_recomputes_less_on_random_networks(family: str):
    for seed in range(3):
        g = random_network(family, 100 + seed, 60)
        for frac in (0.4, 0.6, 0.8):
            budget = int(frac * unoptimised_peak_bytes(g))
            try:
                base = autoremat.solve(g, budget, solver="chen")
            except autoremat.InfeasibleBudgetError:
                continue
            found = polish(g, base, budget)
            if found is None:
                continue
            sim = simulate(g, found, check=False, record=False)
            assert sim.peak_bytes <= budget and sim.extra_time_s < _extra(g, base)
            autoremat.solvers.finalize_plan(g, found, budget, "chen")  # a valid plan (validate_plan)


def test_moves_keep_a_partition_of_the_nodes_in_order():
    starts, flags = [0, 4, 9, 15], [True, False, True, False]
    for s, f in _moves(20, starts, flags):
        assert s[0] == 0 and all(a < b for a, b in zip(s, s[1:])) and s[-1] < 20 and len(s) == len(f)


def test_plans_not_of_its_form_and_large_graphs_are_left_alone(monkeypatch: pytest.MonkeyPatch):
    g = _unet()
    budget = int(0.9 * unoptimised_peak_bytes(g))
    plain = no_recompute_plan(g)
    assert polish(g, autoremat.Plan(plain.segments, offload=(3,)), budget) is None  # offloads
    shuffled = autoremat.Plan([autoremat.Segment((1,), recompute=False), autoremat.Segment((0,), recompute=False),
                               autoremat.Segment(tuple(range(2, len(g))), recompute=False)])
    assert polish(g, shuffled, budget) is None  # not a topological order
    monkeypatch.setattr(polish_mod, "POLISH_MAX_NODES", len(g) - 1)
    dp = autoremat.solve(g, int(0.5 * unoptimised_peak_bytes(g)), solver="dp-approx")
    assert polish(g, dp, int(0.5 * unoptimised_peak_bytes(g))) is None
    assert POLISH_MAX_NODES >= 300


def test_auto_does_not_polish_measured_times(monkeypatch: pytest.MonkeyPatch):
    """Like the lattice search: on measured times a move won by noise would change the plan from
    capture to capture."""
    g = _unet()
    g.meta["time_source"] = "perf_counter"

    def fail(*_a, **_k):
        raise AssertionError("polished")

    monkeypatch.setattr(polish_mod, "polish", fail)
    assert autoremat.solve(g, "50%", noise_tolerance=0).predicted_peak_bytes > 0
    g.meta.pop("time_source")
    # the lattice search runs before the polish on this 95-node graph (seconds) and is not the question
    monkeypatch.setattr(solvers_pkg, "_lattice_for_auto", lambda graph, budget, best: best)
    with pytest.raises(AssertionError, match="polished"):
        solvers_pkg.solve(g, "50%")
