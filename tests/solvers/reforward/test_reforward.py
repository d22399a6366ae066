"""``autoremat.solvers.reforward``: the ``"reforward"`` solver (Feng & Huang, Re-forwarding).

Golden hand-solved cases, the three budget cases, ``validate_plan`` on every result, every small
random DAG against an exhaustive search of all plans, monotonicity in the budget, the multi-input
remedies, module-level graphs, and captured zoo graphs. The paper's structures are
``test_tree.py``'s, Algorithms 1 and 5 ``test_search.py``'s.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
from _graphs import module_graph, plain_dag, rich_dag

import autoremat
from autoremat import Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.plan import Segment
from autoremat.solvers import SOLVERS
from autoremat.solvers.reforward import (
    DivisionNode,
    ReforwardSolution,
    breaks_multi_input_assumption,
    division_tree,
    reforward_arbitrary,
    reforward_linear,
    solution_plan,
    solve_reforward,
)


# ---------------------------------------------------------------------- helpers
def check(graph: Graph, plan: Plan, budget_bytes: int) -> None:
    """What every result of the solver must satisfy."""
    validate_plan(graph, plan)
    sim = simulate(graph, plan)
    assert plan.solver == "reforward"
    assert plan.graph_fingerprint == graph.fingerprint
    assert plan.budget_bytes == budget_bytes
    assert plan.predicted_peak_bytes == sim.peak_bytes <= budget_bytes
    assert plan.predicted_extra_time_s == sim.extra_time_s
    again = Plan.from_json(plan.to_json())
    assert again == plan
    validate_plan(graph, again)


def min_budget(graph: Graph, **config) -> int:
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_reforward(graph, -1, config=config or None)
    assert err.value.solver == "reforward" and err.value.budget_bytes == -1
    assert err.value.min_budget_bytes is not None
    return err.value.min_budget_bytes


def _all_plan_segments(graph: Graph, cap: int) -> list[list[Segment]] | None:
    """Every plan: every increasing lower-set sequence, every allowed recompute flag."""
    n = len(graph)
    full = (1 << n) - 1
    lowers = sorted((sum(1 << v for v in low) for low in graph.lower_sets()), key=int.bit_count)
    sup = {a: [b for b in lowers if b != a and b & a == a] for a in lowers}
    saves = [graph.node(v)["saved_bytes"] > 0 for v in range(n)]
    rec = [graph.node(v)["recomputable"] for v in range(n)]
    count: dict[int, int] = {full: 1}
    for a in sorted(lowers, key=int.bit_count, reverse=True):
        if a != full:
            count[a] = 0
            for b in sup[a]:
                part = [v for v in range(n) if (b & ~a) >> v & 1]
                flags = 2 if b != full and any(saves[v] for v in part) and all(rec[v] for v in part) else 1
                count[a] += flags * count[b]
    if count[0] > cap:
        return None
    out: list[list[Segment]] = []

    def dfs(a: int, segs: list[Segment]) -> None:
        if a == full:
            out.append(list(segs))
            return
        for b in sup[a]:
            part = tuple(v for v in range(n) if (b & ~a) >> v & 1)
            segs.append(Segment(part, False))
            dfs(b, segs)
            segs.pop()
            if b != full and any(saves[v] for v in part) and all(rec[v] for v in part):
                segs.append(Segment(part, True))
                dfs(b, segs)
                segs.pop()

    dfs(0, [])
    return out


def exhaustive(graph: Graph, cap: int = 8000) -> list[tuple[int, float]] | None:
    """``(peak, extra time)`` of every plan (``None`` when there are more than ``cap``)."""
    plans = _all_plan_segments(graph, cap)
    if plans is None:
        return None
    res = []
    for segs in plans:
        s = simulate(graph, Plan(segs), check=False, record=False)
        res.append((s.peak_bytes, s.extra_time_s))
    return res


def small_dags(count: int, seed: int, cap: int = 8000) -> list[tuple[Graph, list[tuple[int, float]]]]:
    """The first ``count`` DAGs (≤ 9 nodes) of a seeded generator with at most ``cap`` plans."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        n = rng.randint(4, 9)
        g = rich_dag(rng, n, p_skip=0.12) if rng.random() < 0.6 else plain_dag(rng, n)
        res = exhaustive(g, cap)
        if res is not None:
            out.append((g, res))
    return out


def walk(node: DivisionNode):
    yield node
    for child in node.children:
        yield from walk(child)


def reforward_module_graph() -> Graph:
    """A module-level chain with a skip (2 -> 5) and a call that cannot be recomputed (3)."""
    return module_graph(8, not_recomputable=(3,), skips=((2, 5),))


# ---------------------------------------------------------------------- registry and API
def test_registered():
    assert SOLVERS["reforward"].solve is solve_reforward
    g = Graph.chain([100] * 8)
    plan = solve(g, unoptimised_peak_bytes(g) - 1, solver="reforward")
    check(g, plan, unoptimised_peak_bytes(g) - 1)
    assert plan.recompute_segments


def test_config_validation():
    g = Graph.chain([100] * 5)
    with pytest.raises(ValueError, match="multi_input='fuse'"):
        solve_reforward(g, 10**9, config={"multi_input": "fuse"})
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_candidates"):
            solve_reforward(g, 10**9, config={"max_candidates": bad})
    with pytest.raises(ValueError, match="method='dp'"):
        solve_reforward(g, 10**9, config={"method": "dp"})
    with pytest.raises(ValueError, match="chain"):
        solve_reforward(Graph.from_edges(3, [(0, 1), (0, 2), (1, 2)]), 10**9, config={"method": "linear"})
    with pytest.raises(ValueError, match="multi_input"):
        reforward_arbitrary(g, multi_input="both")
    with pytest.raises(TypeError, match="autoremat.Graph"):
        solve_reforward(nx.DiGraph(), 10**9)
    # an unknown key is an error naming the accepted ones (solver="auto" hands each solver only its own)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['grid'\]; it accepts: multi_input"):
        solve(g, 10**9, solver="reforward", grid=4)


# ---------------------------------------------------------------------- golden cases
def test_empty_graph():
    g = Graph()
    plan = solve_reforward(g, 0)
    check(g, plan, 0)
    assert plan.segments == []
    assert reforward_arbitrary(g)[0].kept == () and division_tree(g).interior == ()


def test_single_node():
    g = Graph.chain([100])
    plan = solve_reforward(g, 200)
    check(g, plan, 200)
    assert plan.recompute_segments == []
    assert min_budget(g) == 200  # output + its gradient: nothing to re-forward


def test_zero_size_tensors():
    g = Graph.chain([0] * 6)
    plan = solve_reforward(g, 0)
    check(g, plan, 0)
    assert plan.recompute_segments == [] and plan.predicted_peak_bytes == 0
    for sol in reforward_arbitrary(g):
        assert sol.cost_bytes == 0


def test_chain_golden():
    # sizes 100, 10, 100, 10, 100, times 1: Eqn. 1 is least (120) when the two small
    # tensors are kept and each large one is re-forwarded alone: 10 + 10 + max(100, 100, 100).
    g = Graph.chain([100, 10, 100, 10, 100])
    for family in (reforward_linear(g), reforward_arbitrary(g)):
        best = min(family, key=lambda s: s.cost_bytes)
        assert best == ReforwardSolution(120, (1, 3), ((0,), (2,), (4,)), 20, 100)
        assert best.cost_bytes == 120
    # keep everything / re-forward everything are the two ends of the family
    fam = reforward_linear(g)
    assert fam[0].kept == () and fam[0].reforward_bytes == 320
    assert fam[-1].kept == (0, 1, 2, 3, 4) and fam[-1].cost_bytes == 320
    # its plan, by hand: nodes 0 and 2 recomputed (4 is last), 1 and 3 plain.
    # Forward ends with 1, 3, 4 (120); loss gradient 100 -> 220; backward of 4 adds the
    # gradient of 3 (10) -> 230. Re-forwarding 2 later: 10 + 100 + 100 (grad 2) + 10 = 220.
    plan = solution_plan(g, best)
    validate_plan(g, plan)
    assert [(s.nodes, s.recompute) for s in plan.segments] == [
        ((0,), True), ((1,), False), ((2,), True), ((3,), False), ((4,), False)]
    sim = simulate(g, plan)
    assert (sim.peak_bytes, sim.extra_time_s) == (230, 2.0)
    assert unoptimised_peak_bytes(g) == 430
    assert min_budget(g) == 230
    plan = solve_reforward(g, 429)
    check(g, plan, 429)
    assert plan.predicted_peak_bytes == 230 and plan.predicted_extra_time_s == 2.0
    assert plan.options["max_term_bytes"] == 120 and plan.options["paper_kept_bytes"] == 20


def test_budget_above_vanilla_recomputes_nothing():
    g = Graph.chain([100] * 20, [float(i + 1) for i in range(20)])
    peak = unoptimised_peak_bytes(g)
    for budget in (peak, 2 * peak, 10**12):
        plan = solve_reforward(g, budget)
        check(g, plan, budget)
        assert plan.recompute_segments == []
        assert plan.predicted_peak_bytes == peak and plan.predicted_extra_time_s == 0.0


def test_budget_zero_is_infeasible():
    g = Graph.chain([100] * 20)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_reforward(g, 0)
    e = err.value
    assert e.budget_bytes == 0 and e.min_budget_bytes is not None and e.min_budget_bytes > 0
    assert str(e.min_budget_bytes) in str(e)
    plan = solve_reforward(g, e.min_budget_bytes)  # the reported minimum is met exactly
    check(g, plan, e.min_budget_bytes)
    assert plan.predicted_peak_bytes == e.min_budget_bytes
    with pytest.raises(InfeasibleBudgetError):
        solve_reforward(g, e.min_budget_bytes - 1)


# ---------------------------------------------------------------------- three budget cases
@pytest.mark.parametrize("graph", [
    Graph.chain([100] * 20, [float(i + 1) for i in range(20)]),
    Graph.from_edges(8, [(0, 1), (1, 2), (1, 3), (2, 4), (3, 4), (4, 5), (5, 6), (4, 6), (6, 7)],
                     out_bytes=[50, 100, 80, 80, 100, 60, 100, 10]),
], ids=["chain", "dag"])
def test_three_budget_cases(graph):
    peak = unoptimised_peak_bytes(graph)
    low = min_budget(graph)
    assert 0 < low < peak
    # not binding
    plan = solve_reforward(graph, peak)
    check(graph, plan, peak)
    assert plan.recompute_segments == []
    # binding
    for budget in (peak - 1, (peak + low) // 2, low):
        plan = solve_reforward(graph, budget)
        check(graph, plan, budget)
        assert plan.recompute_segments and plan.predicted_extra_time_s > 0
    # infeasible
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_reforward(graph, low - 1)
    assert err.value.min_budget_bytes == low


# ---------------------------------------------------------------------- exhaustive search
SMALL = None


def _small():
    global SMALL
    if SMALL is None:
        SMALL = small_dags(40, seed=7)
    return SMALL


def test_never_beats_the_exhaustive_optimum_on_small_dags():
    for g, res in _small():
        assert len(g) <= 9
        best_peak = min(p for p, _ in res)
        low = min_budget(g)
        assert low >= best_peak
        vanilla = unoptimised_peak_bytes(g)
        assert low <= vanilla
        budgets = sorted({p for p, _ in res if p >= low} | {vanilla, low})
        for b in budgets:
            plan = solve_reforward(g, b)
            check(g, plan, b)
            optimum = min(x for p, x in res if p <= b)
            assert plan.predicted_extra_time_s >= optimum - 1e-9
        if low > 0:
            with pytest.raises(InfeasibleBudgetError):
                solve_reforward(g, low - 1)


def test_extra_time_never_rises_with_budget_on_small_dags():
    for g, res in _small():
        extras = []
        for b in sorted({p for p, _ in res}):
            try:
                plan = solve_reforward(g, b)
            except InfeasibleBudgetError:
                assert not extras  # infeasible only below the least budget
                continue
            extras.append(plan.predicted_extra_time_s)
        assert extras and extras[-1] == 0.0
        assert all(b <= a + 1e-12 for a, b in zip(extras, extras[1:])), extras


@pytest.mark.parametrize("seed", range(4))
def test_plans_valid_on_larger_random_dags(seed):
    rng = random.Random(100 + seed)
    for _ in range(4):
        g = rich_dag(rng, rng.randint(10, 60), p_skip=0.05)
        for mode in ("store", "merge"):
            for sol in reforward_arbitrary(g, multi_input=mode):
                validate_plan(g, solution_plan(g, sol))
        peak = unoptimised_peak_bytes(g)
        extras = []
        for frac in (0.3, 0.5, 0.7, 0.85, 1.0):
            try:
                plan = solve_reforward(g, int(peak * frac))
            except InfeasibleBudgetError:
                continue
            check(g, plan, int(peak * frac))
            extras.append(plan.predicted_extra_time_s)
        assert extras[-1] == 0.0
        assert all(b <= a + 1e-12 for a, b in zip(extras, extras[1:]))


# ---------------------------------------------------------------------- multi-input ops
def attention_like() -> Graph:
    """x -> a -> q, a -> k, q * k (saves both), -> out: the product breaks assumption 2."""
    g = nx.DiGraph()
    spec = [("x", 100, ()), ("a", 100, (0,)), ("q", 100, (1,)), ("k", 100, (1,)), ("q2", 100, (2,)),
            ("k2", 100, (3,)), ("mul", 100, (4, 5)), ("out", 10, (6,))]
    for v, (name, size, saves) in enumerate(spec):
        g.add_node(v, name=name, out_bytes=size, alloc_bytes=size, saves=saves, time_s=1.0, bwd_time_s=2.0,
                   is_output=name == "out")
    g.add_edges_from([(0, 1), (1, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 6), (6, 7)])
    return Graph(g, {"mode": "synthetic", "loss_saves": [7]})


def test_multi_input_remedies():
    g = attention_like()
    assert breaks_multi_input_assumption(g) == [6]
    assert breaks_multi_input_assumption(Graph.from_edges(3, [(0, 2), (1, 2)])) == []  # saves itself only
    store = reforward_arbitrary(g, multi_input="store")
    assert all({4, 5} <= set(s.kept) for s in store)  # the paper's remedy: inputs stored
    merge = reforward_arbitrary(g, multi_input="merge")
    assert any(not {4, 5} & set(s.kept) for s in merge)
    merged = False
    for sol in merge:
        plan = solution_plan(g, sol)
        validate_plan(g, plan)
        for seg in plan.recompute_segments:
            merged |= {4, 5, 6} <= set(seg.nodes)  # both branches re-forwarded with the product
    assert merged
    peak = unoptimised_peak_bytes(g)
    lows = {mode: min_budget(g, multi_input=mode) for mode in ("store", "merge", "both")}
    assert lows["both"] == min(lows["store"], lows["merge"]) < peak
    for mode in ("store", "merge", "both"):
        plan = solve_reforward(g, lows[mode], config={"multi_input": mode})
        check(g, plan, lows[mode])
        if mode != "both":
            assert plan.options.get("multi_input", mode) == mode


def test_nodes_that_cannot_be_recomputed_are_kept():
    g = Graph.chain([100] * 10)
    g.node(4)["recomputable"] = False
    g.node(4)["saves"] = (3, 4)
    g = Graph(g.nx, g.meta)
    for sol in reforward_arbitrary(g):
        assert {3, 4} <= set(sol.kept)
    low = min_budget(g)
    plan = solve_reforward(g, low)
    check(g, plan, low)
    assert 4 not in plan.recomputed_nodes and plan.recompute_segments


# ---------------------------------------------------------------------- module-level graphs
def test_module_graph_three_cases():
    g = reforward_module_graph()
    peak = unoptimised_peak_bytes(g)
    plan = solve_reforward(g, peak)
    check(g, plan, peak)
    assert plan.recompute_segments == []
    low = min_budget(g)
    assert low < peak
    for budget in ((peak + low) // 2, low):
        plan = solve_reforward(g, budget)
        check(g, plan, budget)
        assert plan.recompute_segments
        assert all(len(s.nodes) == 1 for s in plan.recompute_segments)
        assert 3 not in plan.recomputed_nodes
    with pytest.raises(InfeasibleBudgetError):
        solve_reforward(g, low - 1)


# ---------------------------------------------------------------------- captured zoo graphs
@pytest.fixture(scope="module")
def zoo_graphs() -> dict[str, Graph]:
    out = {}
    for name in ("resnet50", "densenet121", "unet"):
        m, a = autoremat.zoo.build(name)
        out[name] = autoremat.capture(m, a, repeats=1, warmup=0)
    return out


@pytest.mark.parametrize("name", ["resnet50", "densenet121", "unet"])
def test_zoo_graphs(zoo_graphs, name):
    g = zoo_graphs[name]
    assert g.meta["mode"] == "fx"
    kinds = {n.kind for n in walk(division_tree(g))}
    assert {1, 2} <= kinds
    if name == "densenet121":
        assert 3 in kinds  # dense blocks have no splitting vertex and no branch
    peak = unoptimised_peak_bytes(g)
    low = min_budget(g, max_candidates=48)
    assert low < 0.8 * peak
    extras = []
    for budget in (low, (low + peak) // 2, peak):
        plan = solve_reforward(g, budget, config={"max_candidates": 48})
        check(g, plan, budget)
        extras.append(plan.predicted_extra_time_s)
    assert extras[0] >= extras[1] >= extras[2] == 0.0
    # the paper's least-Eqn.-1 solution maps to a valid plan that saves memory
    best = min(reforward_arbitrary(g), key=lambda s: s.cost_bytes)
    plan = solution_plan(g, best)
    validate_plan(g, plan)
    assert simulate(g, plan).peak_bytes < peak
