"""Tests for the ``"reforward"`` solver (Feng & Huang, Re-forwarding).

Golden hand-solved cases, the three budget cases, ``validate_plan`` on every result, the
paper's structures (closed-set types, splitting vertices, maximal split) against literal
implementations of its definitions, Algorithm 1 against an exhaustive search of Eqn. 1,
Algorithm 5 against Algorithm 1 on chains, every small random DAG against an exhaustive
search of all plans, monotonicity in the budget, the multi-input remedies, module-level
graphs, and captured zoo graphs.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

import autoremat
from autoremat import Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.plan import Segment
from autoremat.cost import unoptimised_peak_bytes
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


def rich_dag(rng: random.Random, n: int, *, p_skip: float = 0.25) -> Graph:
    """A random profiled DAG: varied sizes and times, saved inputs (multi-input ops that
    break the paper's assumption), extras, views, nodes without grad or not recomputable."""
    g = nx.DiGraph()
    for v in range(n):
        preds = [v - 1] if v and rng.random() < 0.85 else []
        preds += [u for u in range(v - 1) if rng.random() < p_skip]
        if v and not preds:
            preds = [rng.randrange(v)]
        view = bool(preds) and rng.random() < 0.1
        size = rng.choice([0, 10, 50, 100, 400])
        saves = {u for u in preds if rng.random() < 0.4} | ({v} if rng.random() < 0.6 else set())
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=0 if view else size,
                   alias_of=preds[0] if view else None, saves=tuple(saves),
                   extra_saved_bytes=rng.choice([0, 0, 0, 20]), time_s=rng.choice([0.5, 1.0, 2.0, 10.0]),
                   bwd_time_s=2.0, requires_grad=v > 0 or rng.random() < 0.8,
                   recomputable=rng.random() < 0.95)
        g.add_edges_from((u, v) for u in preds)
    for v in range(n):
        g.nodes[v]["is_output"] = g.out_degree(v) == 0
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1]})


def plain_dag(rng: random.Random, n: int) -> Graph:
    """A random DAG through ``Graph.from_edges`` with varied sizes and times."""
    edges = set()
    for v in range(1, n):
        if rng.random() < 0.8:
            edges.add((v - 1, v))
        for u in range(v - 1):
            if rng.random() < 0.3:
                edges.add((u, v))
        if not any(e[1] == v for e in edges):
            edges.add((rng.randrange(v), v))
    sizes = [rng.choice([0, 10, 40, 100, 250]) for _ in range(n)]
    times = [rng.choice([0.5, 1.0, 3.0, 10.0]) for _ in range(n)]
    return Graph.from_edges(n, sorted(edges), out_bytes=sizes, time_s=times)


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


def module_graph(n: int = 8) -> Graph:
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"m{v}", module_path=f"layers.{v}", kind="module", out_bytes=10, alloc_bytes=10,
                   saves=(v,), extra_saved_bytes=50 + 10 * v, time_s=1.0 + v, bwd_time_s=2.0 + 2 * v,
                   is_output=v == n - 1, recomputable=v != 3)
        if v:
            g.add_edge(v - 1, v)
    g.add_edge(2, 5)
    return Graph(g, {"mode": "module", "loss_saves": [n - 1]})


def walk(node: DivisionNode):
    yield node
    for c in node.children:
        yield from walk(c)


# ---------------------------------------------------------------------- registry and API
def test_registered():
    assert SOLVERS["reforward"] is solve_reforward
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


# ---------------------------------------------------------------------- the paper's structures
def test_closed_set_types_of_figure_3():
    # (b) type 1: 0 -> 1 -> 2 with 1 splitting
    t = division_tree(Graph.from_edges(3, [(0, 1), (1, 2)]))
    assert t.kind == 1 and t.splits == (0, 1, 2) and t.children == []
    # (c) type 2: two branches between 0 and 3
    t = division_tree(Graph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)]))
    assert t.kind == 1 and t.splits == (0, 3)
    (mid,) = t.children
    assert (mid.head, mid.tail, mid.kind, mid.interior) == (0, 3, 2, (1, 2))
    assert sorted(c.interior for c in mid.children) == [(1,), (2,)]
    assert all(c.kind == 1 for c in mid.children)
    # an edge head -> tail makes a closed set branched (Algorithm 3, line 2)
    t = division_tree(Graph.from_edges(3, [(0, 1), (1, 2), (0, 2)]))
    (mid,) = t.children
    assert mid.kind == 2 and mid.has_edge and [c.interior for c in mid.children] == [(1,)]
    # (d) / Fig. 4(c) type 3: 1->2, 1->3, 2->3, 2->4, 3->4 (ids shifted by one); its
    # maximal split is five edges, so both inner vertices are endpoints
    t = division_tree(Graph.from_edges(4, [(0, 1), (0, 2), (1, 2), (1, 3), (2, 3)]))
    assert t.kind == 1 and t.splits == (0, 3)
    (mid,) = t.children
    assert mid.kind == 3 and mid.endpoints == (1, 2) and mid.children == []


def test_maximal_split_with_a_closed_member():
    # type 3 between 0 and 6 whose maximal split holds the branched closed set 1 -> {2, 3} -> 4
    edges = [(0, 1), (1, 2), (1, 3), (2, 4), (3, 4), (4, 6), (0, 5), (1, 5), (4, 5), (5, 6)]
    t = division_tree(Graph.from_edges(7, edges))
    (mid,) = t.children
    assert mid.kind == 3 and mid.endpoints == (1, 4, 5)
    (member,) = mid.children
    assert (member.head, member.tail, member.interior, member.kind) == (1, 4, (2, 3), 2)


def test_largest_closed_set_is_the_union_of_independent_branches():
    # between 1 and 4: branch {2} is closed, branch {3} leaks to 5; s_14 = {2}
    edges = [(0, 1), (1, 2), (2, 4), (1, 3), (3, 4), (3, 5), (4, 6), (5, 6), (0, 5)]
    t = division_tree(Graph.from_edges(7, edges))
    members = [c for n in walk(t) if n.kind == 3 for c in n.children]
    assert [(m.head, m.tail, m.interior) for m in members] == [(1, 4, (2,))]


def _closed(graph: Graph, k: int, t: int, verts: set[int]) -> bool:
    """Definition 1, literally (node ids; the sets live inside the real graph)."""
    if not verts:
        return graph.nx.has_edge(k, t)
    anc_t = nx.ancestors(graph.nx, t)
    desc_k = nx.descendants(graph.nx, k)
    if not verts <= anc_t & desc_k:
        return False
    allowed = verts | {k, t}
    return all(w in allowed for v in verts for w in itertools.chain(graph.succ(v), graph.pred(v)))


def _splits_by_algorithm_2(graph: Graph, node: DivisionNode) -> list[int]:
    """Algorithm 2 of the paper for every vertex of a closed set, literally."""
    head, tail, interior = node.head, node.tail, set(node.interior)
    whole = interior | {head, tail}
    sub = graph.nx.subgraph(whole).copy()
    if sub.has_edge(head, tail) and not node.has_edge:
        sub.remove_edge(head, tail)
    out = []
    for v in sorted(interior):
        vin = nx.ancestors(sub, v)
        vout = nx.descendants(sub, v)
        if vin | vout | {v} != whole or vin & vout:
            continue
        if any(sub.has_edge(a, b) or sub.has_edge(b, a) for a in vin for b in vout):
            continue
        out.append(v)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_division_tree_against_the_definitions(seed):
    rng = random.Random(seed)
    checked = set()
    for _ in range(12):
        n = rng.randint(3, 9)
        g = plain_dag(rng, n)
        root = division_tree(g)
        for node in walk(root):
            if node.head is None or node.tail is None:
                continue  # the virtual source / sink are not in the graph
            checked.add(node.kind)
            inner = set(node.interior)
            assert _closed(g, node.head, node.tail, inner)
            if node.kind == 1:
                assert list(node.splits) == _splits_by_algorithm_2(g, node)
            else:
                assert _splits_by_algorithm_2(g, node) == []
            covered = set()
            for c in node.children:
                assert not covered & set(c.interior)
                covered |= set(c.interior)
                assert _closed(g, c.head, c.tail, set(c.interior))
            if node.kind == 2:
                assert covered == inner
            if node.kind == 3:
                assert covered | set(node.endpoints) == inner
                # members are the closed sets with an interior contained in no larger proper one
                found = set()
                pts = sorted(inner | {node.head, node.tail})
                for k, t in itertools.permutations(pts, 2):
                    if (k, t) == (node.head, node.tail):
                        continue
                    cand = (nx.descendants(g.nx, k) & nx.ancestors(g.nx, t)) & inner
                    best: set[int] = set()  # the largest closed set: the union of all of them
                    for r in range(1, len(cand) + 1):
                        for sub in itertools.combinations(sorted(cand), r):
                            if _closed(g, k, t, set(sub)):
                                best |= set(sub)
                    if best:
                        found.add((k, t, tuple(sorted(best))))
                maximal = {c for c in found
                           if not any(set(c[2]) | {c[0], c[1]} < set(d[2]) | {d[0], d[1]} for d in found)}
                assert {(c.head, c.tail, c.interior) for c in node.children} == maximal
    assert checked >= {1, 2}


# ---------------------------------------------------------------------- Algorithm 1 (LCG)
def _eqn1_exhaustive(keep: list[int], inner: list[int]) -> list[tuple[int, int]]:
    """``(kept bytes, largest re-forward)`` of every kept subset of a chain."""
    n = len(keep)
    out = []
    for mask in range(1 << n):
        kept = sum(keep[v] for v in range(n) if mask >> v & 1)
        runs, cur = [], 0
        for v in range(n):
            if mask >> v & 1:
                runs.append(cur)
                cur = 0
            else:
                cur += inner[v]
        runs.append(cur)
        out.append((kept, max(runs)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_linear_solver_is_exact_for_eqn_1(seed):
    rng = random.Random(seed)
    for _ in range(6):
        n = rng.randint(1, 10)
        sizes = [rng.choice([0, 10, 30, 100, 100, 250]) for _ in range(n)]
        g = Graph.chain(sizes, [rng.choice([1.0, 10.0]) for _ in range(n)])
        fam = reforward_linear(g)
        table = _eqn1_exhaustive(sizes, sizes)  # chains: keep = inner = the tensor size
        assert min(s.cost_bytes for s in fam) == min(k + r for k, r in table)
        terms = [s.max_term_bytes for s in fam]
        assert terms == sorted(set(terms), reverse=True)
        for s in fam:
            # the shortest path of the accessibility graph keeps the least under the max term
            assert s.reforward_bytes <= s.max_term_bytes
            assert s.kept_bytes == min(k for k, r in table if r <= s.max_term_bytes)
            assert sorted(s.kept + tuple(v for grp in s.groups for v in grp)) == list(range(n))


@pytest.mark.parametrize("seed", range(3))
def test_linear_and_arbitrary_solvers_agree_on_chains(seed):
    rng = random.Random(seed)
    for _ in range(5):
        n = rng.randint(1, 40)
        g = Graph.chain([rng.choice([0, 5, 50, 100, 300]) for _ in range(n)],
                        [rng.choice([1.0, 10.0]) for _ in range(n)])
        assert reforward_linear(g) == reforward_arbitrary(g)
        peak = unoptimised_peak_bytes(g)
        for budget in (peak, (peak * 2) // 3):
            try:
                lin = solve_reforward(g, budget, config={"method": "linear"})
            except InfeasibleBudgetError as err:
                with pytest.raises(InfeasibleBudgetError) as err2:
                    solve_reforward(g, budget)
                assert err2.value.min_budget_bytes == err.min_budget_bytes
                continue
            acg = solve_reforward(g, budget)
            assert lin.segments == acg.segments
            check(g, acg, budget)


def _eqn1_costs(g: Graph, store: bool) -> tuple[list[int], list[int], set[int]]:
    """``keep``, ``inner`` and the pinned nodes, from the module docstring's definitions."""
    n = len(g)
    saved = set()
    for v in g.nodes:
        if g.node(v)["requires_grad"]:
            saved |= {s for u in g.node(v)["saves"] for s in (u, g.root(u))}
    saved |= {s for u in g.meta["loss_saves"] for s in (u, g.root(u))}
    keep = [g.node(g.root(v))["alloc_bytes"] for v in range(n)]
    inner = [(g.node(v)["alloc_bytes"] if v in saved else 0)
             + (g.node(v)["extra_saved_bytes"] if g.node(v)["requires_grad"] else 0) for v in range(n)]
    pinned = set()
    for v in g.nodes:
        d = g.node(v)
        saves = {s for u in d["saves"] for s in (u, g.root(u))} if d["requires_grad"] else set()
        if not d["recomputable"]:
            pinned |= {v} | saves
        elif store and len(g.pred(v)) > 1:
            pinned |= {s for u in g.pred(v) for s in (u, g.root(u)) if s in saves and s != v}
    return keep, inner, pinned


def _eqn1_optimum(g: Graph, store: bool) -> int:
    """Least Eqn. 1 over every kept set whose re-forwarded parts are closed sets with one
    head and one tail (the model input and the loss being the virtual ones)."""
    keep, inner, pinned = _eqn1_costs(g, store)
    n = len(g)
    best = None
    for mask in range(1 << n):
        kept = {v for v in range(n) if mask >> v & 1}
        if not pinned <= kept:
            continue
        largest, ok, seen = 0, True, set()
        for s in range(n):
            if s in kept or s in seen:
                continue
            comp, stack = {s}, [s]
            while stack:
                x = stack.pop()
                for y in g.succ(x) + g.pred(x):
                    if y not in kept and y not in comp:
                        comp.add(y)
                        stack.append(y)
            seen |= comp
            heads = {u for x in comp for u in g.pred(x) if u not in comp}
            heads |= {"input"} if any(not g.pred(x) for x in comp) else set()
            tails = {w for x in comp for w in g.succ(x) if w not in comp}
            tails |= {"loss"} if any(not g.succ(x) or g.node(x)["is_output"] for x in comp) else set()
            if len(heads) != 1 or len(tails) != 1:
                ok = False
                break
            largest = max(largest, sum(inner[x] for x in comp))
        if ok:
            cost = sum(keep[v] for v in kept) + largest
            best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_solver_is_exact_for_eqn_1_on_small_dags(seed):
    # Algorithms 2-5 reach the least Eqn. 1 over every valid set of kept vertices
    rng = random.Random(20 + seed)
    for _ in range(12):
        n = rng.randint(4, 11)
        g = rich_dag(rng, n, p_skip=0.15) if rng.random() < 0.5 else plain_dag(rng, n)
        for mode in ("store", "merge"):
            fam = reforward_arbitrary(g, multi_input=mode)
            assert min(s.cost_bytes for s in fam) == _eqn1_optimum(g, mode == "store")
            for s in fam:
                assert sorted(s.kept + tuple(v for grp in s.groups for v in grp)) == list(range(n))
                assert s.reforward_bytes <= s.max_term_bytes


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
    g = module_graph()
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
