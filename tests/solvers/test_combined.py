"""``autoremat.solvers.combined``: recomputation plus offloading, never worse than either alone."""

from __future__ import annotations

import pytest

from autoremat import Graph, InfeasibleBudgetError, simulate, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers.combined import CombinedConfig, offload_allowed, solve_combined


def graph(device: str = "meta") -> Graph:
    g = Graph.chain([100 + 10 * (v % 4) for v in range(16)], [1.0 + v % 3 for v in range(16)])
    g.meta["device"] = device
    return g


def test_never_slower_than_recomputation_or_offloading_alone():
    g = graph()
    peak = unoptimised_peak_bytes(g)
    for budget in (int(0.6 * peak), int(0.8 * peak)):
        plan = solve(g, budget, solver="combined")
        validate_plan(g, plan)
        assert simulate(g, plan).peak_bytes <= budget
        for other in ("chen", "dp-approx", "offload-greedy"):
            try:
                alone = solve(g, budget, solver=other)
            except InfeasibleBudgetError:
                continue
            assert plan.predicted_extra_time_s <= alone.predicted_extra_time_s + 1e-9, other


def test_where_offloading_applies():
    assert offload_allowed(graph("cuda:0"), {}) and offload_allowed(graph("meta"), {})
    assert not offload_allowed(graph("cpu"), {}) and offload_allowed(graph("cpu"), {"offload": True})
    assert not offload_allowed(graph("meta"), {"offload": False})
    plan = solve_combined(graph("cpu"), int(0.7 * unoptimised_peak_bytes(graph())))
    assert not plan.offload and plan.options["offload_allowed"] is False


def test_budget_steps_and_infeasible_budgets():
    g = graph()
    assert CombinedConfig().budget_steps == 8
    plan = solve(g, int(0.7 * unoptimised_peak_bytes(g)), solver="combined", budget_steps=2)
    assert plan.options["budget_steps"] == 2
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_combined(g, 0)
    assert err.value.min_budget_bytes > 0 and err.value.solver == "combined"


def test_a_completion_that_cannot_fit_with_everything_offloaded_is_not_searched(monkeypatch):
    """Step 3 first judges each candidate with every storage it keeps offloaded; where even that
    (in its least-memory form) does not fit, no offload set of that candidate is searched, and its
    least peak still counts towards the infeasible budget's reported least budget."""
    import autoremat.solvers.offload_dag as od

    searched = []
    real = od.search_offloads
    monkeypatch.setattr(od, "search_offloads", lambda s, *a, **k: searched.append(s.depths) or real(s, *a, **k))
    g = graph()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_combined(g, 1)
    assert searched == [(1, 2, 4)]  # offload-dag's own search only
    assert err.value.min_budget_bytes > 1
    roomy = int(0.6 * unoptimised_peak_bytes(g))
    searched.clear()
    plan = solve_combined(g, roomy)
    assert plan.predicted_peak_bytes is None or plan.predicted_peak_bytes <= roomy
    assert simulate(g, plan).peak_bytes <= roomy and (1,) in searched


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.5])
def test_saved_units_never_make_combined_slower(fraction: float):
    """The H200's GPT-2 graph (module level, the blocks' own saved tensors offloadable): combined
    with the units as candidates (default) is never predicted slower than without them, and
    fits wherever it fits without; at 0.8x it offloads block internals at no predicted cost."""
    g = Graph.from_json("benchmarks/results/nvidia-h200/offload_gpu/graph_gpt2.json")
    budget = int(fraction * unoptimised_peak_bytes(g))
    without = solve(g, budget, solver="combined", saved_units=False)
    plan = solve(g, budget, solver="combined")
    validate_plan(g, plan)
    assert plan.predicted_extra_time_s <= without.predicted_extra_time_s + 1e-12
    if fraction == 0.8:
        assert plan.offload_saved and plan.predicted_extra_time_s < without.predicted_extra_time_s


def test_saved_units_never_make_combined_slower_on_random_graphs():
    """Seeded random DAGs whose nodes keep tensors of their own (ten times rich_dag's, meta device):
    with the units combined is never predicted slower and meets every budget it met without them;
    on some it is faster (the units hide behind compute where recomputation costs time)."""
    import random

    from _graphs import rich_dag

    compared = faster = 0
    for seed in range(4):
        rng = random.Random(seed)
        d = rich_dag(rng, rng.randint(10, 18))
        for v in d.nodes:
            d.nx.nodes[v]["extra_saved_bytes"] *= 10
        g = Graph(d.nx, {**d.meta, "device": "meta", "bandwidth_bytes_per_s": rng.choice([50.0, 500.0])})
        for frac in (0.7, 0.9):
            budget = int(frac * unoptimised_peak_bytes(g))
            try:
                without = solve(g, budget, solver="combined", saved_units=False)
            except InfeasibleBudgetError:
                continue
            plan = solve(g, budget, solver="combined")
            assert plan.predicted_extra_time_s <= without.predicted_extra_time_s + 1e-12
            compared += 1
            faster += plan.predicted_extra_time_s < without.predicted_extra_time_s
    assert compared >= 4 and faster >= 1
