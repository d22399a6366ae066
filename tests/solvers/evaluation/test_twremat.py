"""``autoremat.solvers.evaluation.twremat``: TWRemat(k) schedules (Kumar et al.), evaluated only.

Tree decompositions satisfy Lemma 1 and the centroid is a balanced separator; every schedule is
valid (``tests/_schedules.py``'s checker and :func:`simulate_schedule`); memory grows sub-linearly
with depth and ``k`` trades memory for length; arguments are checked.
"""

from __future__ import annotations


import networkx as nx
import pytest
from _graphs import random_profiled_graphs
from _schedules import all_schedules, check_schedule, figure1

import autoremat
from autoremat.cost.schedule import JointGraph, no_remat, simulate_schedule
from autoremat.graph import Graph
from autoremat.solvers.evaluation.twremat import (
    balanced_separator,
    shrink_decomposition,
    tree_decomposition,
    twremat_schedule,
    validate_tree_decomposition,
)

SIZE = 100


@pytest.fixture(scope="module")
def resnet50_small() -> Graph:
    m, a = autoremat.zoo.build("resnet50")
    return autoremat.capture(m, a)


# ---------------------------------------------------------------------- tree decomposition
def test_tree_decomposition_lemma1_and_separator():
    for g in random_profiled_graphs(10, seed=1) + [Graph.chain([1] * 40)]:
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
