"""``autoremat.solvers.evaluation.offload_bruteforce``: the yardstick of ``offload-dag``, itself checked."""

from __future__ import annotations

import pytest

from autoremat import SOLVERS, Graph, InfeasibleBudgetError, simulate
from autoremat.cost import no_recompute_plan
from autoremat.plan import Plan, Segment, validate_plan
from autoremat.solvers.evaluation import solve_offload_bruteforce


def test_not_binding_offloads_nothing_and_the_minimum_is_the_least_peak_of_every_set():
    g = Graph.chain([100] * 5, [1.0] * 5)
    peak = simulate(g, no_recompute_plan(g)).peak_bytes
    assert solve_offload_bruteforce(g, peak).offload == ()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_offload_bruteforce(g, 0, bandwidth_bytes_per_s=1e12)
    least = err.value.min_budget_bytes
    plan = solve_offload_bruteforce(g, least, bandwidth_bytes_per_s=1e12)
    assert simulate(g, plan, bandwidth_bytes_per_s=1e12).peak_bytes == least < peak
    assert "offload-bruteforce" not in SOLVERS


def test_it_picks_the_fastest_fitting_set_and_its_waits():
    """A slow link: the set that fits without stalling is preferred; where only forward waits
    make a set fit, the plan carries them and simulates to the same step."""
    g = Graph.chain([100] * 8, [1.0] * 8)
    slow = 20.0  # 5 s per copy against 1 s nodes
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_offload_bruteforce(g, 0, bandwidth_bytes_per_s=slow)
    budget = err.value.min_budget_bytes
    plan = solve_offload_bruteforce(g, budget, bandwidth_bytes_per_s=slow)
    validate_plan(g, plan)
    sim = simulate(g, plan, bandwidth_bytes_per_s=slow)
    assert sim.peak_bytes <= budget < simulate(g, no_recompute_plan(g)).peak_bytes
    for k in range(1, 8):  # no prefix of the production order (with derived waits or not) is faster
        for limit in (None, budget):
            other = simulate(g, Plan(plan.segments, offload=tuple(range(k))), bandwidth_bytes_per_s=slow,
                             offload_wait_limit_bytes=limit)
            assert other.peak_bytes > budget or other.extra_time_s >= sim.extra_time_s


def test_a_recomputed_base_offers_its_checkpoints_and_large_sets_are_refused():
    g = Graph.chain([100] * 7 + [300] * 3, [1.0] * 10)
    base = Plan([Segment((0, 1), False), Segment(tuple(range(2, 7)), True), Segment((7, 8, 9), False)])
    plan = solve_offload_bruteforce(g, simulate(g, base).peak_bytes - 1, base=base, bandwidth_bytes_per_s=1e9)
    assert 1 in plan.offload  # the region's input, an offloaded checkpoint
    with pytest.raises(ValueError, match="max_candidates"):
        solve_offload_bruteforce(Graph.chain([10] * 14), 10, bandwidth_bytes_per_s=1e9)
