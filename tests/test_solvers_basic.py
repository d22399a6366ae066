"""Tests for the "none" and "chen" solvers through autoremat.solve and autoremat.SOLVERS.

Every solver gets the three budget cases (not binding, binding, infeasible), golden cases,
``validate_plan`` on every result, and the property that extra time never rises as the
budget grows.
"""

from __future__ import annotations

import inspect
import random

import networkx as nx
import pytest

import autoremat
from autoremat import SOLVERS, Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.cost import no_recompute_plan, unoptimised_peak_bytes
from autoremat.solvers.chen import segment_by_threshold, split_candidates

N = 20
SIZE = 100


def long_chain() -> Graph:
    return Graph.chain([SIZE] * N, [float(i + 1) for i in range(N)])


def module_graph(n: int = 10) -> Graph:
    """Module-level chain: each call keeps internal activations (extra_saved_bytes)."""
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"m{v}", module_path=f"layers.{v}", kind="module", out_bytes=10, alloc_bytes=10,
                   saves=(v,), extra_saved_bytes=50 + 10 * v, time_s=1.0 + v, bwd_time_s=2.0 + 2 * v,
                   is_output=v == n - 1)
        if v:
            g.add_edge(v - 1, v)
    return Graph(g, {"mode": "module", "loss_saves": [n - 1]})


def check(graph: Graph, plan: Plan, budget_bytes: int, solver: str) -> None:
    """What every solver result must satisfy."""
    validate_plan(graph, plan)
    sim = simulate(graph, plan)
    assert plan.solver == solver
    assert plan.budget_bytes == budget_bytes
    assert plan.graph_fingerprint == graph.fingerprint
    assert plan.predicted_peak_bytes == sim.peak_bytes
    assert plan.predicted_extra_time_s == sim.extra_time_s
    assert sim.peak_bytes <= budget_bytes
    # the plan survives JSON and stays valid
    again = Plan.from_json(plan.to_json())
    assert again == plan
    validate_plan(graph, again)


# ---------------------------------------------------------------------- registry and API
def test_registry():
    assert {"none", "chen"} <= set(SOLVERS)
    assert autoremat.SOLVERS is SOLVERS
    for name, fn in SOLVERS.items():
        assert callable(fn), name
        params = inspect.signature(fn).parameters
        assert list(params)[:2] == ["graph", "budget_bytes"], name
        assert params["config"].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params["config"].default is None, name


def test_registry_functions_called_directly():
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    for name, fn in SOLVERS.items():
        plan = fn(g, peak)
        assert isinstance(plan, Plan)
        validate_plan(g, plan)
        assert simulate(g, plan).peak_bytes <= peak


def test_unknown_solver():
    with pytest.raises(ValueError) as err:
        solve(long_chain(), 10**9, solver="magic")
    msg = str(err.value)
    assert "'magic'" in msg and "'chen'" in msg and "'none'" in msg and "auto" in msg


@pytest.mark.parametrize("bad", [None, "graph", nx.DiGraph(), 42])
def test_not_a_graph(bad):
    with pytest.raises(TypeError, match="autoremat.Graph"):
        solve(bad, 10**9)


def test_bad_budget():
    with pytest.raises(ValueError, match="budget="):
        solve(long_chain(), "lots", solver="chen")


def test_budget_forms_through_solve():
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    assert solve(g, "50%", solver="chen").budget_bytes == peak // 2
    assert solve(g, 0.75, solver="chen").budget_bytes == int(peak * 3 // 4)
    assert solve(g, "1MB", solver="none").budget_bytes == 10**6
    plan = solve(g, "auto", solver="none")  # host memory dwarfs a 2 kB graph
    assert plan.budget_bytes > peak and plan.recompute_segments == []


# ---------------------------------------------------------------------- three budget cases
@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_not_binding(solver):
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    for budget in (peak, 2 * peak, 10**12):
        plan = solve(g, budget, solver=solver)
        check(g, plan, budget, "none" if solver == "auto" else solver)
        assert plan.recompute_segments == []
        assert plan.predicted_peak_bytes == peak
        assert plan.predicted_extra_time_s == 0.0


@pytest.mark.parametrize("solver", ["chen", "auto"])
def test_binding(solver):
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    for frac in (0.95, 0.8, 0.6):
        budget = int(peak * frac)
        plan = solve(g, budget, solver=solver)
        check(g, plan, budget, "chen" if solver == "chen" else plan.solver)
        if solver == "auto":  # auto picks the least extra time among the registered solvers
            assert plan.solver in ("chen", "dp-approx")
            assert plan.predicted_extra_time_s <= solve(g, budget, solver="chen").predicted_extra_time_s
        assert plan.recompute_segments, frac
        assert plan.predicted_peak_bytes <= budget < peak
        assert plan.predicted_extra_time_s > 0.0


def test_binding_none_is_infeasible():
    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, peak - 1, solver="none")
    assert err.value.min_budget_bytes == peak
    assert err.value.budget_bytes == peak - 1
    assert err.value.solver == "none"


@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
@pytest.mark.parametrize("budget", [0, 1, 500])
def test_infeasible(solver, budget):
    g = long_chain()
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, budget, solver=solver)
    e = err.value
    assert isinstance(e, ValueError)
    assert e.solver == solver and e.budget_bytes == budget
    assert e.min_budget_bytes is not None and e.min_budget_bytes > budget
    assert str(e.min_budget_bytes) in str(e)
    # the reported minimum is met exactly
    plan = solve(g, e.min_budget_bytes, solver=solver)
    check(g, plan, e.min_budget_bytes, plan.solver)
    assert plan.predicted_peak_bytes == e.min_budget_bytes
    with pytest.raises(InfeasibleBudgetError):
        solve(g, e.min_budget_bytes - 1, solver=solver)


def test_auto_minimum_is_the_least_of_the_solvers():
    g = long_chain()
    mins = {}
    for name in ("none", "chen", "dp-approx", "auto"):
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(g, 0, solver=name)
        mins[name] = err.value.min_budget_bytes
    assert mins["auto"] == min(mins["none"], mins["chen"], mins["dp-approx"]) < mins["none"]


# ---------------------------------------------------------------------- golden cases
@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_empty_graph(solver):
    g = Graph()
    plan = solve(g, 0, solver=solver)
    check(g, plan, 0, "none" if solver == "auto" else solver)
    assert plan.segments == []


@pytest.mark.parametrize("solver", ["none", "chen", "auto"])
def test_zero_size_tensors(solver):
    g = Graph.chain([0] * 6)
    plan = solve(g, 0, solver=solver)
    check(g, plan, 0, "none" if solver == "auto" else solver)
    assert plan.recompute_segments == [] and plan.predicted_peak_bytes == 0


def test_single_node():
    g = Graph.chain([100])
    assert solve(g, 200, solver="chen").recompute_segments == []
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 199, solver="chen")
    assert err.value.min_budget_bytes == 200


def test_chen_uniform_chain_golden():
    # 20 nodes x 100 bytes, times 1..20, unoptimised peak 2200 (= (20 + 2) x 100).
    g = long_chain()
    assert unoptimised_peak_bytes(g) == 2200
    # Cheapest plan of chen's family under any binding budget above 1200: recompute the first
    # half. By hand: forward keeps outputs 10..19 (1000); backward of 19 adds its gradient and
    # that of 18 (1200); at node 9 the replay holds 10 copies + gradient 9 (1100), and backward
    # of 9 adds gradient 8 (1200). Extra time 1 + ... + 10 = 55.
    plan = solve(g, 2199, solver="chen")
    assert [s.nodes for s in plan.recompute_segments] == [tuple(range(10))]
    assert plan.predicted_peak_bytes == 1200
    assert plan.predicted_extra_time_s == 55.0
    assert solve(g, 1200, solver="chen").predicted_extra_time_s == 55.0
    # below 1200 two recomputed segments are needed, and they cost more
    plan = solve(g, 1199, solver="chen")
    assert len(plan.recompute_segments) == 2 and plan.predicted_extra_time_s > 55.0
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 0, solver="chen")
    m = err.value.min_budget_bytes
    assert m == 900
    assert solve(g, m, solver="chen").predicted_peak_bytes == m


def test_chen_helpers():
    chain = Graph.chain([100] * 4)
    assert split_candidates(chain) == [0, 1, 2]
    assert split_candidates(Graph.from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])) == [0]
    assert split_candidates(Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])) == [0]
    # 0 -> 1 -> 2 -> 3 -> 4 with a skip 1 -> 3: cutting after 0, 1 or 3 keeps one tensor
    assert split_candidates(Graph.from_edges(5, [(0, 1), (1, 2), (2, 3), (1, 3), (3, 4)])) == [0, 1, 3]
    assert segment_by_threshold(chain, 150, {0, 1, 2}) == [[0, 1], [0, 1, 2, 3]]
    assert segment_by_threshold(chain, 0, {0, 1, 2}) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert segment_by_threshold(chain, 10**9, {0, 1, 2}) == [[0, 1, 2, 3]]


def test_chen_options():
    g = long_chain()
    plan = solve(g, 2000, solver="chen", grid=4)
    check(g, plan, 2000, "chen")
    assert plan.options["grid"] == 4
    assert plan.options["graph_mode"] == "synthetic"
    assert plan.options["node_names"] == [f"n{i}" for i in range(N)]
    with pytest.raises(ValueError, match="grid"):
        solve(g, 2000, solver="chen", grid=0)


# ---------------------------------------------------------------------- module-level graphs
def test_chen_module_mode_three_cases():
    g = module_graph()
    peak = unoptimised_peak_bytes(g)
    plan = solve(g, peak, solver="chen")
    check(g, plan, peak, "chen")
    assert plan.recompute_segments == []
    budget = int(peak * 0.6)
    plan = solve(g, budget, solver="chen")
    check(g, plan, budget, "chen")
    assert plan.recompute_segments
    assert all(len(s.nodes) == 1 for s in plan.recompute_segments)
    assert plan.options["node_names"] == [f"layers.{v}" for v in range(len(g))]
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, 10, solver="chen")
    m = err.value.min_budget_bytes
    assert m is not None and m > 10
    check(g, solve(g, m, solver="chen"), m, "chen")


# ---------------------------------------------------------------------- properties
def _budget_sweep(g: Graph, solver: str, steps: int) -> list[tuple[int, float]]:
    peak = unoptimised_peak_bytes(g)
    out = []
    for i in range(steps + 1):
        budget = int(peak * (0.2 + 1.0 * i / steps))
        try:
            plan = solve(g, budget, solver=solver)
        except InfeasibleBudgetError:
            continue
        validate_plan(g, plan)
        assert plan.predicted_peak_bytes <= budget
        out.append((budget, plan.predicted_extra_time_s))
    return out


def _assert_non_increasing(results: list[tuple[int, float]]) -> None:
    extras = [e for _, e in results]
    assert all(b <= a + 1e-12 for a, b in zip(extras, extras[1:])), results


def _random_dag(seed: int) -> Graph:
    rng = random.Random(seed)
    n = rng.randint(6, 30)
    edges = {(v - 1, v) for v in range(1, n)}
    edges |= {(u, v) for u in range(n) for v in range(u + 2, min(n, u + 4)) if rng.random() < 0.3}
    return Graph.from_edges(n, sorted(edges), out_bytes=[rng.choice([10, 100, 1000]) for _ in range(n)],
                            time_s=[rng.choice([1.0, 10.0]) for _ in range(n)])


@pytest.mark.parametrize("solver", ["chen", "auto"])
def test_extra_time_never_rises_with_budget_chains(solver):
    for sizes in ([100] * 30, [10 * (i % 7 + 1) for i in range(40)], [1000, 1, 1000, 1, 500, 500, 2000, 3]):
        g = Graph.chain(sizes, [1.0 + (i % 3) for i in range(len(sizes))])
        results = _budget_sweep(g, solver, 24)
        assert results and results[-1][1] == 0.0
        _assert_non_increasing(results)


@pytest.mark.parametrize("seed", range(6))
def test_extra_time_never_rises_with_budget_random_dags(seed):
    g = _random_dag(seed)
    results = _budget_sweep(g, "chen", 16)
    assert results and results[-1][1] == 0.0
    _assert_non_increasing(results)


def test_extra_time_never_rises_with_budget_module_graph():
    _assert_non_increasing(_budget_sweep(module_graph(12), "chen", 24))


@pytest.fixture(scope="module")
def resnet_graph() -> Graph:
    m, a = autoremat.zoo.build("resnet50")
    return autoremat.capture(m, a, repeats=1, warmup=0)


def test_zoo_resnet50_chen(resnet_graph):
    g = resnet_graph
    assert g.meta["mode"] == "fx" and len(g) > 100
    peak = unoptimised_peak_bytes(g)
    # three budget cases on a real graph
    plan = solve(g, peak, solver="chen")
    check(g, plan, peak, "chen")
    assert plan.recompute_segments == []
    budget = int(peak * 0.7)
    plan = solve(g, budget, solver="chen")
    check(g, plan, budget, "chen")
    assert plan.recompute_segments and plan.predicted_extra_time_s > 0
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, int(peak * 0.1), solver="chen")
    m = err.value.min_budget_bytes
    check(g, solve(g, m, solver="chen"), m, "chen")
    # property over a grid of budgets
    results = _budget_sweep(g, "chen", 12)
    assert len(results) >= 8 and results[-1][1] == 0.0
    _assert_non_increasing(results)
    # same with the papers' time convention
    gp = g.with_paper_times()
    _assert_non_increasing(_budget_sweep(gp, "chen", 8))


def test_no_recompute_plan_is_the_none_solution():
    g = long_chain()
    plan = solve(g, 10**9, solver="none")
    assert plan.segments == no_recompute_plan(g).segments


def test_a_solver_plan_over_budget_is_never_returned(monkeypatch):
    """Whatever a solver returns, solve() rejects a plan that simulates over the budget."""
    import autoremat.solvers as solvers
    from autoremat.cost import no_recompute_plan

    g = long_chain()
    peak = unoptimised_peak_bytes(g)
    monkeypatch.setitem(solvers.SOLVERS, "liar", lambda graph, budget, *, config=None: no_recompute_plan(graph))
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(g, peak - 1, solver="liar")
    assert err.value.min_budget_bytes == peak
