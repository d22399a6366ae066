"""``dp-exact`` and ``dp-approx`` (:mod:`autoremat.solvers.kusumoto`): hand-solved cases, brute force, options.

Golden hand-solved cases (empty graph, budget 0, above the unoptimised peak, zero-size tensors,
chains solved by hand); on every small DAG of a seeded generator dp-exact equals brute force
(:mod:`autoremat.solvers.evaluation.bruteforce`) and dp-approx and Chen never beat it, more
budget never costs more and ``min_budget`` is tight; the options are recorded and validated; the
fallback of dp-exact on large families; module-level graphs; the registry; a zoo graph and a
600-node one. The reference answers are ``test_golden.py``'s.
"""

from __future__ import annotations

import logging

import pytest
from _graphs import random_dag, skip_chain

import autoremat
from autoremat import SOLVERS, Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.plan import segments_from_lower_sets
from autoremat.solvers import min_budget as exported_min_budget
from autoremat.solvers.chen import solve_chen
from autoremat.solvers.evaluation.bruteforce import lower_set_chains, solve_bruteforce
from autoremat.solvers.kusumoto import min_budget, solve_dp_approx, solve_dp_exact

DP = {"dp-exact": solve_dp_exact, "dp-approx": solve_dp_approx}


# ---------------------------------------------------------------------------------------- helpers
def oracle_table(graph: Graph) -> list[tuple[int, float]]:
    """``(peak, extra time)`` of every plan brute force considers."""
    out = []
    for chain in lower_set_chains(graph):
        sim = simulate(graph, Plan(segments_from_lower_sets(graph, chain)), check=False, record=False)
        out.append((sim.peak_bytes, sim.extra_time_s))
    return out


def oracle(table: list[tuple[int, float]], budget: int) -> float | None:
    """Brute force's least extra time within ``budget`` (``None``: infeasible)."""
    fits = [t for p, t in table if p <= budget]
    return min(fits) if fits else None


def outcome(solver, graph: Graph, budget: int, **config) -> float | None:
    """Extra time of the solver's plan (checked: valid, within budget), or ``None`` if infeasible."""
    try:
        plan = solver(graph, budget, config=config or None)
    except InfeasibleBudgetError as err:
        assert err.min_budget_bytes is not None and err.min_budget_bytes > budget
        return None
    validate_plan(graph, plan)
    sim = simulate(graph, plan)
    assert sim.peak_bytes <= budget, (solver.__name__, sim.peak_bytes, budget)
    return sim.extra_time_s


def small_graphs() -> list[tuple[int, Graph]]:
    """Seeded random DAGs of 1..7 nodes, at most 2500 lower-set chains each."""
    out = []
    seed = 0
    while len(out) < 36:
        g = random_dag(seed, 1 + seed % 7)
        if sum(1 for _ in lower_set_chains(g)) <= 2500:
            out.append((seed, g))
        seed += 1
    return out


SMALL = small_graphs()


def chain4() -> Graph:
    return Graph.chain([100] * 4)


# ---------------------------------------------------------------------------------------- hand-solved
@pytest.mark.parametrize("name", sorted(DP))
def test_empty_graph(name):
    g = Graph()
    plan = DP[name](g, 0)
    validate_plan(g, plan)
    assert plan.segments == []
    assert min_budget(g, name) == 0


@pytest.mark.parametrize("name", sorted(DP))
def test_chain4_hand_solved(name):
    """4 nodes of 100 bytes saving their outputs: vanilla 600 = 4 outputs + the output gradient
    + node 2's gradient; recomputing {0} gives 500, {0, 1} gives 400, {0, 1, 2} gives 500."""
    g = chain4()
    assert unoptimised_peak_bytes(g) == 600
    plan = DP[name](g, 600)  # not binding: no recomputation
    validate_plan(g, plan)
    assert plan.recompute_segments == [] and simulate(g, plan).extra_time_s == 0
    plan = DP[name](g, 599)  # binding
    validate_plan(g, plan)
    assert [s.nodes for s in plan.recompute_segments] == [(0,)]
    assert (simulate(g, plan).peak_bytes, simulate(g, plan).extra_time_s) == (500, 1.0)
    plan = DP[name](g, 400)
    validate_plan(g, plan)
    assert [s.nodes for s in plan.recompute_segments] == [(0, 1)]
    assert simulate(g, plan).peak_bytes == 400
    with pytest.raises(InfeasibleBudgetError) as info:  # infeasible, with the true minimum
        DP[name](g, 399)
    assert info.value.min_budget_bytes == 400 == min_budget(g, name)


@pytest.mark.parametrize("name", sorted(DP))
def test_chain12_time_centric_optimum(name):
    """At 800 of 1400 bytes the cheapest plan recomputes the first half once (6 s)."""
    g = Graph.chain([100] * 12)
    plan = DP[name](g, 800)
    validate_plan(g, plan)
    assert [s.nodes for s in plan.segments] == [tuple(range(6)), tuple(range(6, 12))]
    assert simulate(g, plan).extra_time_s == 6.0
    assert min_budget(g, name) == 700


@pytest.mark.parametrize("name", sorted(DP))
def test_budget_zero_is_infeasible(name):
    g = random_dag(3, 6)
    with pytest.raises(InfeasibleBudgetError) as info:
        DP[name](g, 0)
    assert info.value.min_budget_bytes > 0
    assert info.value.min_budget_bytes == min_budget(g, name)
    assert info.value.solver == name


@pytest.mark.parametrize("name", sorted(DP))
def test_budget_above_vanilla_recomputes_nothing(name):
    for _, g in SMALL[:12]:
        peak = unoptimised_peak_bytes(g)
        for budget in (peak, peak + 1, 10 * peak + 10):
            plan = DP[name](g, budget)
            validate_plan(g, plan)
            assert plan.recompute_segments == []
            assert simulate(g, plan).extra_time_s == 0


@pytest.mark.parametrize("name", sorted(DP))
def test_zero_size_tensors(name):
    g = Graph.chain([0] * 5)
    assert unoptimised_peak_bytes(g) == 0
    plan = DP[name](g, 0)
    assert plan.recompute_segments == []
    assert min_budget(g, name) == 0
    mixed = Graph.chain([0, 50, 0, 50, 0, 50])
    need = min_budget(mixed, name)
    plan = DP[name](mixed, need)
    validate_plan(mixed, plan)
    assert simulate(mixed, plan).peak_bytes <= need < unoptimised_peak_bytes(mixed)


# ---------------------------------------------------------------------------------------- brute force
@pytest.mark.parametrize("seed,g", SMALL, ids=[f"seed{s}" for s, _ in SMALL])
def test_against_brute_force(seed, g):
    """dp-exact equals brute force; dp-approx and chen never beat it; exact <= approx;
    every plan fits; more budget never costs more; min_budget is tight for both DPs."""
    table = oracle_table(g)
    least = min(p for p, _ in table)
    peak = unoptimised_peak_bytes(g)
    budgets = sorted({0, least - 1, least, (least + peak) // 2, peak - 1, peak, peak + 7} - {-1})
    mid = (least + peak) // 2
    assert simulate(g, solve_bruteforce(g, mid)).extra_time_s == oracle(table, mid)
    previous: dict[str, float | None] = {}
    for budget in budgets:
        best = oracle(table, budget)
        exact = outcome(solve_dp_exact, g, budget)
        approx = outcome(solve_dp_approx, g, budget)
        chen = outcome(solve_chen, g, budget)
        assert exact == best, (seed, budget)
        for name, got in (("dp-approx", approx), ("chen", chen)):
            assert best is not None or got is None
            assert got is None or got >= best, (name, seed, budget)
        assert approx is None or exact <= approx
        for name, got in (("dp-exact", exact), ("dp-approx", approx), ("chen", chen)):
            if previous.get(name) is not None:  # feasible stays feasible, and never costs more
                assert got is not None and got <= previous[name], (name, seed, budget)
            previous[name] = got
    assert min_budget(g, "dp-exact") == least
    for name in DP:
        need = min_budget(g, name)
        assert outcome(DP[name], g, need) is not None
        if need > 0:
            assert outcome(DP[name], g, need - 1) is None


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("name", sorted(DP))
def test_memory_objective(name):
    g = Graph.chain([100] * 12)
    need = min_budget(g, name)
    time_plan = DP[name](g, 1000)
    mem_plan = DP[name](g, 1000, config={"objective": "memory"})
    validate_plan(g, mem_plan)
    mem, tim = simulate(g, mem_plan), simulate(g, time_plan)
    assert mem.peak_bytes <= need <= tim.peak_bytes <= 1000
    assert mem.extra_time_s >= tim.extra_time_s
    assert mem_plan.options["objective"] == "memory"
    # memory-centric recomputes even when the budget does not bind
    assert DP[name](g, 10**6, config={"objective": "memory"}).recompute_segments


@pytest.mark.parametrize("name", sorted(DP))
def test_options_recorded_and_validated(name):
    g = Graph.chain([100] * 12)
    plan = DP[name](g, 800, config={"time_slots": 64})
    assert plan.options["time_slots"] == 64 and plan.options["time_quantum_s"] == 1.0
    assert plan.options["family"] and plan.options["memory_model"]
    plan = DP[name](Graph.chain([100] * 12, [0.1 * (i + 1) for i in range(12)]), 800, config={"time_slots": 10})
    assert plan.options["time_quantum_s"] == pytest.approx(0.78)
    for bad in ({"objective": "fast"}, {"time_slots": 0}, {"max_tightenings": -1}, {"max_lower_sets": 1.5}):
        with pytest.raises(ValueError):
            DP[name](g, 800, config=bad)
    for bad_budget in (-1, 1.5, "1MB", True):
        with pytest.raises(ValueError, match="budget_bytes"):
            DP[name](g, bad_budget)
    with pytest.raises(ValueError, match="solver"):
        min_budget(g, "chen")


def test_unknown_options_are_a_value_error():
    with pytest.raises(ValueError, match=r"dp-approx: unknown option\(s\) \['grid'\]; it accepts: objective"):
        solve_dp_approx(Graph.chain([100] * 12), 800, config={"grid": 4})


def test_exact_falls_back_or_raises_on_large_families(caplog):
    g = Graph.from_edges(6, [(0, v) for v in range(1, 6)])  # 2**5 + 1 lower sets
    with caplog.at_level(logging.WARNING, logger="autoremat.solvers.kusumoto"):
        plan = solve_dp_exact(g, unoptimised_peak_bytes(g) - 1, config={"max_lower_sets": 10})
    assert "falling back to dp-approx" in caplog.text
    assert plan.options["fallback"].startswith("dp-approx")
    assert plan.options["family"].startswith("pruned")
    with pytest.raises(ValueError, match="max_lower_sets=10"):
        solve_dp_exact(g, unoptimised_peak_bytes(g) - 1, config={"max_lower_sets": 10, "fallback": False})


def test_module_level_graphs_recompute_single_module_calls():
    g = random_dag(11, 7)
    data = g.to_dict()
    data["meta"]["mode"] = "module"
    data["nodes"][2]["recomputable"] = False
    mod = Graph.from_dict(data)
    table = oracle_table(mod)
    least = min(p for p, _ in table)
    for budget in (least, (least + unoptimised_peak_bytes(mod)) // 2):
        for name, solver in DP.items():
            plan = solver(mod, budget)
            validate_plan(mod, plan)  # recomputed segments: one recomputable node each
            assert all(len(s.nodes) == 1 and s.nodes != (2,) for s in plan.recompute_segments)
            assert simulate(mod, plan).peak_bytes <= budget
        assert outcome(solve_dp_exact, mod, budget) == oracle(table, budget)


# ---------------------------------------------------------------------------------------- registry
def test_registered_and_usable_through_solve():
    assert SOLVERS["dp-exact"].solve is solve_dp_exact and SOLVERS["dp-approx"].solve is solve_dp_approx
    assert exported_min_budget is autoremat.min_budget  # issue 3: autoremat.min_budget(g, solver)
    g = Graph.chain([100] * 12)
    assert all(exported_min_budget(g, name) == min_budget(g, name) for name in DP)  # the DP's own search
    for name in DP:
        plan = solve(g, "60%", solver=name)
        assert plan.solver == name and plan.predicted_peak_bytes <= plan.budget_bytes
    assert solve(g, "60%").predicted_extra_time_s == 6.0  # "auto" takes the best of none/chen/dp-approx


def test_zoo_graph_on_meta():
    """A real network captured on the meta device: valid plans, tight min_budget."""
    import autoremat

    model, args = autoremat.zoo.build("resnet50", size="small", device="meta")
    g = autoremat.capture(model, args).with_paper_times()
    peak = unoptimised_peak_bytes(g)
    need = min_budget(g, "dp-approx")
    assert 0 < need < peak
    for budget in (need, (need + peak) // 2, peak):
        plan = solve_dp_approx(g, budget)
        validate_plan(g, plan)
        assert simulate(g, plan).peak_bytes <= budget
    with pytest.raises(InfeasibleBudgetError):
        solve_dp_approx(g, need - 1)


def test_dp_approx_on_a_600_node_graph():
    """dp-approx on 600 nodes gives a valid plan within budget; its 0.5 s speed target is
    measured by ``benchmarks/solver_speed.py``, not asserted here (wall clock on shared cores)."""
    g = skip_chain(600)
    peak = unoptimised_peak_bytes(g)
    need = min_budget(g, "dp-approx")
    assert 0 < need < peak
    plan = solve_dp_approx(g, (need + peak) // 2)
    validate_plan(g, plan)
    assert simulate(g, plan).peak_bytes <= (need + peak) // 2
