"""``autoremat.solvers.reforward.tree``: the paper's structures against literal implementations.

Closed-set types (Figure 3), maximal splits, the largest closed set of independent branches,
splitting vertices and the division tree against the definitions, on small and random DAGs.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest
from _graphs import plain_dag

from autoremat import Graph
from autoremat.solvers.reforward import DivisionNode, division_tree


def walk(node: DivisionNode):
    yield node
    for c in node.children:
        yield from walk(c)


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
