"""``autoremat.solvers.xla_greedy``: XLA's GreedyRemat schedule and the registered ``"xla-greedy"``.

Not binding it is NoRemat; every plan goes through ``validate_plan`` and ``simulate``; the three
budget cases on chains, random DAGs, a module-level graph and ResNet-50; options and golden cases.
"""

from __future__ import annotations


import pytest
from _graphs import module_graph, random_profiled_graphs

import autoremat
from autoremat import Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.cost.schedule import JointGraph, no_remat, simulate_schedule
from autoremat.solvers import SOLVERS
from autoremat.solvers.xla_greedy import plan_from_recomputed, solve_xla_greedy, xla_greedy_schedule

SIZE = 100


@pytest.fixture(scope="module")
def resnet50_small() -> Graph:
    m, a = autoremat.zoo.build("resnet50")
    return autoremat.capture(m, a)


def test_greedy_schedule_arguments():
    with pytest.raises(ValueError, match="memory_limit_bytes="):
        xla_greedy_schedule(Graph.chain([SIZE] * 3), -1)


def test_greedy_schedule_not_binding_is_noremat():
    for j in [JointGraph.from_graph(g) for g in random_profiled_graphs(8, seed=2)]:
        nr_sched = no_remat(j)
        peak = simulate_schedule(j, nr_sched).peak_bytes
        s = xla_greedy_schedule(j, peak)
        assert s.computes == nr_sched.computes and s.options["remats"] == s.options["moves"] == 0


# ---------------------------------------------------------------------- "xla-greedy" solver
def check_plan(graph: Graph, plan: Plan, budget_bytes: int) -> None:
    validate_plan(graph, plan)
    assert plan.solver == "xla-greedy"
    assert simulate(graph, plan).peak_bytes <= budget_bytes
    assert Plan.from_json(plan.to_json()) == plan


def least_peak(graph: Graph) -> int:
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_xla_greedy(graph, -1)
    assert err.value.solver == "xla-greedy"
    return err.value.min_budget_bytes


def test_xla_greedy_registered():
    assert SOLVERS["xla-greedy"].solve is solve_xla_greedy
    assert "twremat" not in SOLVERS  # evaluated on schedules, not executable as a flat plan


@pytest.mark.parametrize("which", ["chain", "random", "module", "resnet50"])
def test_xla_greedy_three_budget_cases(which, resnet50_small):
    if which == "chain":
        graphs = [Graph.chain([SIZE] * 20, [float(i + 1) for i in range(20)])]
    elif which == "random":
        graphs = random_profiled_graphs(12, seed=3)
    elif which == "module":
        graphs = [module_graph(8)]
    else:
        graphs = [resnet50_small]
    binding = 0
    for g in graphs:
        peak = unoptimised_peak_bytes(g)
        # not binding: no recomputation
        for budget in (peak, 2 * peak):
            plan = solve(g, budget, solver="xla-greedy")
            check_plan(g, plan, budget)
            assert plan.recompute_segments == [] and plan.predicted_extra_time_s == 0.0
        least = least_peak(g)
        assert least <= peak
        # infeasible: the reported minimum is met exactly, one byte less is not
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(g, least - 1, solver="xla-greedy")
        assert err.value.min_budget_bytes == least
        plan = solve(g, least, solver="xla-greedy")
        check_plan(g, plan, least)
        assert plan.predicted_peak_bytes == least
        # binding: peak within budget; extra time never rises as the budget grows
        if least == peak:
            continue
        binding += 1
        last = None
        for i in range(9):
            budget = least + (peak - 1 - least) * i // 8
            plan = solve(g, budget, solver="xla-greedy")
            check_plan(g, plan, budget)
            assert plan.recompute_segments and plan.predicted_peak_bytes <= budget < peak
            if which == "module":
                assert all(len(s.nodes) == 1 for s in plan.recompute_segments)
            if last is not None:
                assert plan.predicted_extra_time_s <= last
            last = plan.predicted_extra_time_s
    assert 2 * binding >= len(graphs)


def test_xla_greedy_saves_memory_on_a_chain():
    g = Graph.chain([SIZE] * 20)
    assert least_peak(g) < 0.7 * unoptimised_peak_bytes(g)


def test_xla_greedy_options_and_golden_cases():
    g = Graph.chain([SIZE] * 4)
    with pytest.raises(ValueError, match="unknown option.*it accepts: none"):
        solve_xla_greedy(g, 10**9, config={"grid": 3})
    empty = Graph()
    check_plan(empty, solve(empty, 0, solver="xla-greedy"), 0)
    zeros = Graph.chain([0] * 6)
    plan = solve(zeros, 0, solver="xla-greedy")
    check_plan(zeros, plan, 0)
    assert plan.recompute_segments == []
    plan = plan_from_recomputed(Graph.chain([SIZE] * 6), {1, 2, 4})
    assert [(s.nodes, s.recompute) for s in plan.segments] == [
        ((0,), False), ((1, 2), True), ((3,), False), ((4,), True), ((5,), False)]
