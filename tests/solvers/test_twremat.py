"""Tests for the joint-graph schedules: NoRemat, TWRemat(k) and XLA's GreedyRemat, and the
registered ``"xla-greedy"`` solver.

Every schedule goes through :func:`simulate_schedule`, the validity checker (each compute has
its inputs resident and is not resident itself, every free names a resident value, every node
is computed, the final node stays). Every plan goes through ``validate_plan`` and
``simulate``.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest

import autoremat
from autoremat import Graph, InfeasibleBudgetError, Plan, simulate, solve, validate_plan
from autoremat.cost import unoptimised_peak_bytes
from autoremat.solvers import SOLVERS
from autoremat.solvers.schedule import (
    COMPUTE,
    FREE,
    JointGraph,
    Op,
    Schedule,
    no_remat,
    simulate_schedule,
    with_liveness_frees,
)
from autoremat.solvers.twremat import (
    balanced_separator,
    shrink_decomposition,
    tree_decomposition,
    twremat_schedule,
    validate_tree_decomposition,
)
from autoremat.solvers.xla_greedy import plan_from_recomputed, solve_xla_greedy, xla_greedy_schedule

SIZE = 100


# ---------------------------------------------------------------------- graphs
def random_graph(rng: random.Random, n: int) -> Graph:
    """A random profiled DAG: random sizes, saves, extras, views, a few nodes without grad."""
    g = nx.DiGraph()
    for v in range(n):
        preds = [u for u in range(v) if rng.random() < min(0.5, 2.5 / max(1, v))]
        if v and not preds:
            preds = [rng.randrange(v)]
        view = bool(preds) and rng.random() < 0.15
        size = rng.choice([0, 10, 50, 100, 400])
        saves = {u for u in preds if rng.random() < 0.5} | ({v} if rng.random() < 0.5 else set())
        g.add_node(v, name=f"n{v}", out_bytes=size, alloc_bytes=0 if view else size,
                   alias_of=preds[0] if view else None, saves=tuple(saves),
                   extra_saved_bytes=rng.choice([0, 0, 0, 20]), time_s=rng.uniform(0.5, 2.0),
                   bwd_time_s=rng.uniform(1.0, 4.0), requires_grad=v > 0 or rng.random() < 0.7,
                   fwd_temp_bytes=rng.choice([0, 0, 30]), bwd_temp_bytes=rng.choice([0, 0, 30]))
        g.add_edges_from((u, v) for u in preds)
    for v in range(n):
        g.nodes[v]["is_output"] = g.out_degree(v) == 0
    outs = [v for v in range(n) if g.out_degree(v) == 0]
    return Graph(g, {"mode": "synthetic", "loss_saves": outs[:1]})


def random_graphs(count: int = 25, seed: int = 0) -> list[Graph]:
    rng = random.Random(seed)
    return [random_graph(rng, rng.randint(1, 30)) for _ in range(count)]


def module_graph(n: int = 8) -> Graph:
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, name=f"m{v}", module_path=f"layers.{v}", kind="module", out_bytes=10, alloc_bytes=10,
                   saves=(v,), extra_saved_bytes=50 + 10 * v, time_s=1.0 + v, bwd_time_s=2.0 + 2 * v,
                   is_output=v == n - 1)
        if v:
            g.add_edge(v - 1, v)
    return Graph(g, {"mode": "module", "loss_saves": [n - 1]})


def figure1() -> JointGraph:
    """Kumar et al. Figure 1: A->B, B->C, B->D, C->D, A->E, D->E; unit sizes; E is final."""
    A, B, C, D, E = range(5)
    return JointGraph.from_dag(nx.DiGraph([(A, B), (B, C), (B, D), (C, D), (A, E), (D, E)]))


@pytest.fixture(scope="module")
def resnet50_small() -> Graph:
    m, a = autoremat.zoo.build("resnet50")
    return autoremat.capture(m, a)


def check_schedule(joint: JointGraph, schedule: Schedule):
    """Validity (by the simulator) plus an independent replay of the same rules."""
    stats = simulate_schedule(joint, schedule)
    resident: set[int] = set()
    computed: set[int] = set()
    for action, v in schedule.ops:
        if action == COMPUTE:
            assert all(u in resident for u in joint.pred[v]) and v not in resident
            resident.add(v)
            computed.add(v)
        else:
            assert action == FREE and v in resident
            resident.discard(v)
    assert computed == set(range(len(joint))) and joint.final in resident
    assert stats.n_computes == len(schedule.computes)
    return stats


# ---------------------------------------------------------------------- joint graph and simulator
def test_joint_graph_of_a_chain():
    g = Graph.chain([SIZE] * 3, [1.0, 2.0, 3.0])
    j = JointGraph.from_graph(g)
    assert [j.name(v) for v in range(len(j))] == [
        "fwd 0", "fwd 1", "fwd 2", "loss", "bwd 2", "bwd 1", "bwd 0", "final"]
    assert j.pred == [[], [0], [1], [2], [2, 3], [1, 4], [0, 5], [6]]
    assert j.size_bytes == [SIZE, SIZE, SIZE, SIZE, SIZE, SIZE, 0, 0]
    assert j.time_s == [1.0, 2.0, 3.0, 0.0, 6.0, 4.0, 2.0, 0.0]
    assert j.final == 7 and j.fwd == {0: 0, 1: 1, 2: 2} and j.bwd == {2: 4, 1: 5, 0: 6}


def test_joint_graph_views_and_extras():
    g = nx.DiGraph()
    g.add_node(0, out_bytes=8, alloc_bytes=8, saves=())
    g.add_node(1, out_bytes=8, alloc_bytes=0, alias_of=0, saves=())  # a view of 0
    g.add_node(2, out_bytes=8, alloc_bytes=8, saves=(1,), extra_saved_bytes=3, is_output=True)
    g.add_edges_from([(0, 1), (1, 2)])
    j = JointGraph.from_graph(Graph(g, {"loss_saves": []}))
    names = [j.name(v) for v in range(len(j))]
    assert names == ["fwd 0", "fwd 1", "fwd 2", "extra 2", "loss", "bwd 2", "bwd 1", "bwd 0", "final"]
    assert j.pred[2] == [0, 1]  # a consumer of the view also holds its storage
    assert j.pred[3] == [2] and j.size_bytes[3] == 3 and j.time_s[3] == 0.0
    assert j.pred[5] == [0, 3, 4]  # bwd 2: loss seed, the saved view's storage, its extras


def test_figure1_memory_of_the_paper():
    j = figure1()
    assert simulate_schedule(j, no_remat(j)).peak_bytes == 4
    remat = with_liveness_frees(j, [0, 1, 2, 3, 0, 4])
    stats = simulate_schedule(j, remat)
    assert stats.peak_bytes == 3 and stats.n_computes == 6 and stats.time_s == 6.0
    assert stats.max_recomputations == 2 and stats.recomputed_nodes == 1
    assert remat.ops[:3] == [Op(COMPUTE, 0), Op(COMPUTE, 1), Op(FREE, 0)]


@pytest.mark.parametrize("ops, message", [
    ([Op(COMPUTE, 1)], "not resident"),
    ([Op(COMPUTE, 0), Op(COMPUTE, 0)], "already resident"),
    ([Op(FREE, 0)], "not resident"),
    ([Op(COMPUTE, 0), Op(COMPUTE, 1), Op(COMPUTE, 2), Op(COMPUTE, 3), Op(COMPUTE, 4), Op(FREE, 4)],
     "final node"),
    ([Op(COMPUTE, 9)], "outside"),
    ([Op("load", 0)], "action"),
])
def test_simulator_rejects_invalid_schedules(ops, message):
    with pytest.raises(ValueError, match=message):
        simulate_schedule(figure1(), ops)


def test_simulator_requires_every_node():
    # node 1 is no ancestor of the final node 2 (built directly; from_dag refuses two sinks)
    j = JointGraph([[], [], [0]], [1, 1, 1], [1.0] * 3, [0] * 3, ["node"] * 3, [0, 1, 2], final=2)
    ops = [Op(COMPUTE, 0), Op(COMPUTE, 2), Op(FREE, 0)]
    with pytest.raises(ValueError, match="never computed"):
        simulate_schedule(j, ops)
    assert simulate_schedule(j, ops, require_all=False).peak_bytes == 2
    with pytest.raises(ValueError, match="exactly one sink"):
        JointGraph.from_dag(nx.DiGraph([(0, 2), (1, 3)]))
    with pytest.raises(ValueError, match="never computed before"):
        with_liveness_frees(figure1(), [0, 2])


def test_noremat_chain_golden():
    # forward keeps every output for its backward; peak at the last node's backward: n outputs,
    # the loss seed and that backward's input gradient (the first node's backward makes none)
    for n in (1, 2, 4, 16):
        j = JointGraph.from_graph(Graph.chain([SIZE] * n))
        stats = check_schedule(j, no_remat(j))
        assert stats.peak_bytes == (n + 2 - (n == 1)) * SIZE and stats.n_computes == len(j) == 2 * n + 2


def test_empty_and_zero_size_graphs():
    for g in (Graph(), Graph.chain([0] * 5)):
        j = JointGraph.from_graph(g)
        for s in (no_remat(j), twremat_schedule(j), twremat_schedule(j, annotated=True), xla_greedy_schedule(j)):
            assert check_schedule(j, s).peak_bytes == 0


# ---------------------------------------------------------------------- tree decomposition
def test_tree_decomposition_lemma1_and_separator():
    for g in random_graphs(10, seed=1) + [Graph.chain([1] * 40)]:
        j = JointGraph.from_graph(g)
        td = tree_decomposition(j)
        validate_tree_decomposition(j, td)
        small = shrink_decomposition(td)
        validate_tree_decomposition(j, small)
        assert len(small) <= len(j) and small.width == td.width
        for a in range(len(small)):  # no adjacent bag is a subset of another
            for b in small.adj[a]:
                assert not small.bags[a] <= small.bags[b]
        c = balanced_separator(small, list(range(len(small))))
        rest = nx.Graph([(a, b) for a in range(len(small)) for b in small.adj[a] if c not in (a, b)])
        rest.add_nodes_from(x for x in range(len(small)) if x != c)
        assert all(2 * len(comp) <= len(small) for comp in nx.connected_components(rest))


def test_validate_tree_decomposition_catches_a_missing_edge():
    j = figure1()
    td = tree_decomposition(j)
    broken = type(td)([frozenset(b - {0}) for b in td.bags], td.adj)
    with pytest.raises(ValueError):
        validate_tree_decomposition(j, broken)


# ---------------------------------------------------------------------- schedule validity
def all_schedules(j: JointGraph) -> dict[str, Schedule]:
    return {
        "noremat": no_remat(j),
        "tw1": twremat_schedule(j),
        "tw1-annotated": twremat_schedule(j, annotated=True),
        "tw4": twremat_schedule(j, 4),
        "tw4-min-degree": twremat_schedule(j, 4, heuristic="min_degree", annotated=True),
        "greedy": xla_greedy_schedule(j),
        "greedy-half": xla_greedy_schedule(j, simulate_schedule(j, no_remat(j)).peak_bytes // 2),
    }


@pytest.mark.parametrize("case", ["chain", "random", "paper-dag"])
def test_schedules_are_valid(case):
    if case == "chain":
        joints = [JointGraph.from_graph(Graph.chain([SIZE] * n, [1.0 + i for i in range(n)])) for n in (1, 2, 7, 33)]
    elif case == "random":
        joints = [JointGraph.from_graph(g) for g in random_graphs(25)]
    else:
        joints = [figure1()]
    for j in joints:
        nr = check_schedule(j, no_remat(j))
        for name, s in all_schedules(j).items():
            stats = check_schedule(j, s)
            assert stats.n_computes >= nr.n_computes, name
        tight = simulate_schedule(j, twremat_schedule(j)).peak_bytes
        assert tight <= simulate_schedule(j, twremat_schedule(j, annotated=True)).peak_bytes


def test_schedules_are_valid_on_resnet50(resnet50_small):
    j = JointGraph.from_graph(resnet50_small)
    nr = check_schedule(j, no_remat(j))
    stats = {name: check_schedule(j, s) for name, s in all_schedules(j).items()}
    assert stats["tw1"].peak_bytes < nr.peak_bytes / 2
    assert stats["greedy"].peak_bytes < nr.peak_bytes
    assert stats["greedy"].n_computes <= 2 * nr.n_computes


# ---------------------------------------------------------------------- TWRemat properties
def test_twremat_memory_is_sublinear_in_depth():
    peaks = {}
    for n in (16, 256):
        j = JointGraph.from_graph(Graph.chain([SIZE] * n))
        peaks[n] = (check_schedule(j, no_remat(j)).peak_bytes, check_schedule(j, twremat_schedule(j)).peak_bytes)
    nr_ratio = peaks[256][0] / peaks[16][0]
    tw_ratio = peaks[256][1] / peaks[16][1]
    assert nr_ratio > 12  # linear: (256 + 2) / (16 + 2)
    assert tw_ratio < 3  # logarithmic in the paper's analysis
    assert peaks[256][1] < peaks[256][0] / 10


@pytest.mark.parametrize("which", ["chain", "resnet50"])
def test_twremat_k_trades_memory_for_length(which, resnet50_small):
    g = Graph.chain([SIZE] * 64) if which == "chain" else resnet50_small
    j = JointGraph.from_graph(g)
    nr_sched = no_remat(j)
    nr = simulate_schedule(j, nr_sched)
    full = twremat_schedule(j, 1)
    bags = full.options["bags"]
    none = twremat_schedule(j, bags + 1)  # recursion never starts: NoRemat
    assert none.computes == nr_sched.computes
    assert simulate_schedule(j, none).peak_bytes == nr.peak_bytes
    lo = simulate_schedule(j, full)
    assert lo.peak_bytes < nr.peak_bytes and lo.n_computes > nr.n_computes
    mid = simulate_schedule(j, twremat_schedule(j, max(2, bags // 8)))
    assert lo.peak_bytes <= mid.peak_bytes <= nr.peak_bytes
    assert nr.n_computes <= mid.n_computes <= lo.n_computes


def test_twremat_arguments():
    g = Graph.chain([SIZE] * 3)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="k="):
            twremat_schedule(g, bad)
    with pytest.raises(ValueError, match="heuristic="):
        twremat_schedule(g, heuristic="exact")
    with pytest.raises(TypeError):
        twremat_schedule(nx.DiGraph())
    with pytest.raises(ValueError, match="memory_limit_bytes="):
        xla_greedy_schedule(g, -1)


def test_greedy_schedule_not_binding_is_noremat():
    for j in [JointGraph.from_graph(g) for g in random_graphs(8, seed=2)]:
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
    assert SOLVERS["xla-greedy"] is solve_xla_greedy
    assert "twremat" not in SOLVERS  # evaluated on schedules, not executable as a flat plan


@pytest.mark.parametrize("which", ["chain", "random", "module", "resnet50"])
def test_xla_greedy_three_budget_cases(which, resnet50_small):
    if which == "chain":
        graphs = [Graph.chain([SIZE] * 20, [float(i + 1) for i in range(20)])]
    elif which == "random":
        graphs = random_graphs(12, seed=3)
    elif which == "module":
        graphs = [module_graph()]
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
