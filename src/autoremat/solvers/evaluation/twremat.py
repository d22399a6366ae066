"""TWRemat: rematerialization by divide and conquer on a tree decomposition (Kumar et al.).

Problem. Given a computation graph in which every node produces one tensor, find a schedule
(nodes may be computed several times) whose peak memory is small. Here the graph is the joint
forward+backward graph of one training step (:class:`~autoremat.cost.schedule.JointGraph`,
whose module docstring says how a :class:`~autoremat.graph.Graph`'s bytes map to the paper's
per-node sizes) and the result is a :class:`~autoremat.cost.schedule.Schedule`.

Paper: .. [1] R. Kumar, M. Purohit, Z. Svitkina, E. Vee, J. R. Wang, "Efficient
   Rematerialization for Deep Networks", NeurIPS 2019 (Algorithm 1, Lemma 1, Lemma 3,
   Theorem 5, and §4.3 for the recursion limit ``TWRemat(k)``).

Method. A tree decomposition of the (undirected) joint graph is computed with networkx's
minimum fill-in heuristic, as in the paper's implementation, and shrunk to at most ``N`` bags
by merging adjacent bags of which one contains the other (Lemma 1, union-find, one pass).
Algorithm 1 then recurses: the centroid bag ``X*`` of the current subtree (Jordan; Lemma 3)
is a balanced separator; its nodes are computed in topological order, each after
recursively computing its inputs inside every remaining component; each component is then
called once more for the outputs it owes; separator nodes are freed at the end. Pieces of the
decomposition and their separators are memoised, so each is split once.

Decisions. (1) Algorithm 1 as printed computes *every* node of ``X*``; a separator node that
is no ancestor of the requested set ``S`` may have an input in an enclosing separator that is
not computed yet, which would make the schedule invalid. We compute only the separator nodes
that are ancestors of ``S`` inside the current node set, which keeps Lemma 4's invariant (every
input from outside the piece is resident) and never lengthens the schedule. (2) ``TWRemat(k)``
stops the recursion when the current piece has fewer than ``k`` bags and computes the
required nodes in topological order, freeing each when it is dead (``k = 1`` is the full
algorithm; ``k`` above the number of bags is NoRemat). (3) By default the frees are re-derived
from the sequence of computations (:func:`~autoremat.cost.schedule.with_liveness_frees`):
that is the paper's ``M(σ)``, which depends on the computations only and is never above the
annotated schedule's; ``annotated=True`` keeps Algorithm 1's own keep/free annotations.

Complexity (Theorem 5, with ``w`` the width of the decomposition, ``N`` joint nodes): the
decomposition heuristic is O(N³) worst case in networkx's implementation (in practice it
dominates for graphs of a few thousand nodes); the recursion has O(log N) levels and emits a
schedule of O(N · w · N^log2(w+2)) computations in the worst case, O(N log² N)-like on chains,
with peak memory O((M_in + w · M_max) · log N). Approximation algorithm for memory (a
polylogarithmic factor of the best possible peak when the treewidth is small); not optimal,
and the length can grow polynomially.

Limitations. The schedule recomputes forward *and* backward nodes, any number of times, in
an interleaving that flat non-reentrant checkpoint segments (what autoremat's runtime
executes) cannot express. TWRemat is therefore **not registered as a solver**: it is
evaluated with the schedule simulator
(:func:`~autoremat.cost.schedule.simulate_schedule`) on the papers' memory model, not
executed, and its numbers are not step peaks of :func:`autoremat.simulate`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
from networkx.algorithms.approximation import treewidth_min_degree, treewidth_min_fill_in

from ...graph import Graph
from ...cost.schedule import COMPUTE, FREE, JointGraph, Op, Schedule, with_liveness_frees

__all__ = [
    "TreeDecomposition",
    "tree_decomposition",
    "shrink_decomposition",
    "balanced_separator",
    "validate_tree_decomposition",
    "twremat_schedule",
]

logger = logging.getLogger(__name__)

_HEURISTICS: dict[str, Callable[[nx.Graph], tuple[int, nx.Graph]]] = {
    "min_fill_in": treewidth_min_fill_in,
    "min_degree": treewidth_min_degree,
}


@dataclass
class TreeDecomposition:
    """Bags (sets of joint nodes) and the tree on them, as adjacency lists."""

    bags: list[frozenset[int]]
    adj: list[list[int]]

    @property
    def width(self) -> int:
        """Largest bag size minus one."""
        return max((len(b) for b in self.bags), default=0) - 1

    def __len__(self) -> int:
        return len(self.bags)


def tree_decomposition(joint: JointGraph, *, heuristic: str = "min_fill_in") -> TreeDecomposition:
    """A tree decomposition of the undirected joint graph by a networkx heuristic.

    ``heuristic``: ``"min_fill_in"`` (the paper's choice) or ``"min_degree"`` (faster).
    """
    if heuristic not in _HEURISTICS:
        raise ValueError(f"heuristic={heuristic!r} is not supported; expected one of {sorted(_HEURISTICS)}")
    und = nx.Graph()
    und.add_nodes_from(range(len(joint)))
    und.add_edges_from((u, v) for v, ps in enumerate(joint.pred) for u in ps)
    if len(joint) == 0:
        return TreeDecomposition([], [])
    _, tree = _HEURISTICS[heuristic](und)
    bags = list(tree.nodes)
    index = {b: i for i, b in enumerate(bags)}
    adj: list[list[int]] = [[] for _ in bags]
    for a, b in tree.edges:
        adj[index[a]].append(index[b])
        adj[index[b]].append(index[a])
    return TreeDecomposition([frozenset(b) for b in bags], adj)


def shrink_decomposition(td: TreeDecomposition) -> TreeDecomposition:
    """Lemma 1: merge adjacent bags of which one contains the other (one pass, union-find).

    The result has the same width and at most as many bags as the graph has nodes.
    """
    parent = list(range(len(td)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    edges = [(a, b) for a in range(len(td)) for b in td.adj[a] if a < b]
    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra == rb:
            continue
        if td.bags[ra] <= td.bags[rb]:
            parent[ra] = rb
        elif td.bags[rb] <= td.bags[ra]:
            parent[rb] = ra
    roots = sorted({find(a) for a in range(len(td))})
    new_index = {r: i for i, r in enumerate(roots)}
    adj: list[set[int]] = [set() for _ in roots]
    for a, b in edges:
        ra, rb = new_index[find(a)], new_index[find(b)]
        if ra != rb:
            adj[ra].add(rb)
            adj[rb].add(ra)
    out = TreeDecomposition([td.bags[r] for r in roots], [sorted(s) for s in adj])
    n_nodes = len(set().union(*td.bags)) if td.bags else 0
    assert len(out) <= max(1, n_nodes), (
        f"Lemma 1 left {len(out)} bags for {n_nodes} nodes, please report")
    return out


def validate_tree_decomposition(joint: JointGraph, td: TreeDecomposition) -> None:
    """Raise ``ValueError`` unless ``td`` is a tree decomposition of the undirected joint graph."""
    n = len(joint)
    if n == 0:
        return
    tree = nx.Graph()
    tree.add_nodes_from(range(len(td)))
    tree.add_edges_from((a, b) for a in range(len(td)) for b in td.adj[a])
    if not nx.is_tree(tree):
        raise ValueError("the bags do not form a tree")
    where: dict[int, list[int]] = {}
    for i, bag in enumerate(td.bags):
        for v in bag:
            where.setdefault(v, []).append(i)
    missing = [v for v in range(n) if v not in where]
    if missing:
        raise ValueError(f"nodes in no bag: {missing[:10]}")
    for v, ps in enumerate(joint.pred):
        for u in ps:
            if not any(u in td.bags[i] for i in where[v]):
                raise ValueError(f"edge {u}-{v} is in no bag")
    for v, bs in where.items():
        if not nx.is_connected(tree.subgraph(bs)):
            raise ValueError(f"the bags holding node {v} are not connected")


def balanced_separator(td: TreeDecomposition, bag_ids: list[int]) -> int:
    """Lemma 3 (Jordan): a bag of the subtree on ``bag_ids`` whose removal leaves components of
    at most ``len(bag_ids) / 2`` bags each. O(len(bag_ids))."""
    inset = set(bag_ids)
    root = bag_ids[0]
    parent = {root: -1}
    order = [root]
    stack = [root]
    while stack:
        x = stack.pop()
        for y in td.adj[x]:
            if y in inset and y not in parent:
                parent[y] = x
                order.append(y)
                stack.append(y)
    assert len(order) == len(inset), "a piece of the tree decomposition is not connected, please report"
    size = dict.fromkeys(order, 1)
    biggest_child = dict.fromkeys(order, 0)
    for x in reversed(order):
        p = parent[x]
        if p >= 0:
            size[p] += size[x]
            biggest_child[p] = max(biggest_child[p], size[x])
    m = len(order)
    best, best_val = root, m
    for x in order:
        val = max(m - size[x], biggest_child[x])
        if val < best_val:
            best, best_val = x, val
    assert 2 * best_val <= m, "no balanced separator bag found, please report"
    return best


@dataclass
class _Piece:
    """A connected part of the tree decomposition and the joint nodes it still owns."""

    bags: list[int]
    nodes: frozenset[int]
    separator: list[int] | None = None
    children: list["_Piece"] = field(default_factory=list)


class _TWRemat:
    def __init__(self, joint: JointGraph, td: TreeDecomposition, k: int) -> None:
        self.joint = joint
        self.td = td
        self.k = k
        self.ops: list[Op] = []
        self.calls = 0

    def split(self, piece: _Piece) -> None:
        """Memoised: the separator ``X* ∩ V'`` (topological order) and the components."""
        if piece.separator is not None:
            return
        td = self.td
        c = balanced_separator(td, piece.bags)
        sep = td.bags[c] & piece.nodes
        piece.separator = sorted(sep)
        inset = set(piece.bags)
        inset.discard(c)
        seen: set[int] = set()
        for start in td.adj[c]:
            if start not in inset or start in seen:
                continue
            comp = [start]
            seen.add(start)
            stack = [start]
            while stack:
                x = stack.pop()
                for y in td.adj[x]:
                    if y in inset and y not in seen:
                        seen.add(y)
                        comp.append(y)
                        stack.append(y)
            nodes = frozenset().union(*(td.bags[b] for b in comp)) & piece.nodes
            piece.children.append(_Piece(comp, nodes - sep))

    def needed(self, piece: _Piece, targets: set[int]) -> set[int]:
        """``targets`` and their ancestors inside the piece."""
        pred = self.joint.pred
        need = set(targets)
        stack = list(targets)
        nodes = piece.nodes
        while stack:
            x = stack.pop()
            for u in pred[x]:
                if u in nodes and u not in need:
                    need.add(u)
                    stack.append(u)
        return need

    def run(self, piece: _Piece, targets: set[int]) -> None:
        """Algorithm 1 on ``piece``: compute ``targets``; on return exactly they stay resident
        among the piece's nodes. Inputs from outside the piece are resident (Lemma 4)."""
        self.calls += 1
        ops = self.ops
        pred = self.joint.pred
        need = self.needed(piece, targets)
        if len(piece.bags) < self.k or len(piece.bags) == 1:
            order = sorted(need)
            last: dict[int, int] = {}
            for j, x in enumerate(order):
                for u in pred[x]:
                    if u in need:
                        last[u] = j
            frees: dict[int, list[int]] = {}
            for u, j in last.items():
                if u not in targets:
                    frees.setdefault(j, []).append(u)
            for j, x in enumerate(order):
                ops.append(Op(COMPUTE, x))
                for u in frees.get(j, ()):
                    ops.append(Op(FREE, u))
            return
        self.split(piece)
        assert piece.separator is not None
        sep = set(piece.separator)
        for v in piece.separator:
            if v not in need:
                continue
            computed: list[int] = []
            for child in piece.children:
                sub = {u for u in pred[v] if u in child.nodes}
                if sub:
                    self.run(child, sub)
                    computed.extend(sub)
            ops.append(Op(COMPUTE, v))
            for u in computed:
                ops.append(Op(FREE, u))
        for child in piece.children:
            sub = {u for u in targets if u in child.nodes}
            if sub:
                self.run(child, sub)
        for v in piece.separator:
            if v in need and v not in targets:
                ops.append(Op(FREE, v))


def twremat_schedule(graph: Graph | JointGraph, k: int | None = None, *, heuristic: str = "min_fill_in",
                     annotated: bool = False) -> Schedule:
    """``TWRemat(k)`` (Algorithm 1 of [1]_ with the recursion limit of §4.3) on the joint graph.

    ``graph``: a :class:`~autoremat.graph.Graph` (its joint forward+backward graph is built)
    or a :class:`~autoremat.cost.schedule.JointGraph`. ``k``: stop the recursion on pieces
    with fewer than ``k`` bags (``None`` or 1: the full algorithm). ``heuristic``: the tree
    decomposition heuristic (``"min_fill_in"`` as in the paper, or ``"min_degree"``).
    ``annotated``: keep Algorithm 1's frees instead of the liveness frees.

    The returned schedule's ``options`` record ``k``, the width and number of bags of the
    shrunk decomposition, and the number of recursive calls.
    """
    joint = JointGraph.coerce(graph)
    if k is None:
        k = 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive integer (the recursion limit in bags) or None")
    td = shrink_decomposition(tree_decomposition(joint, heuristic=heuristic))
    options = {"k": k, "heuristic": heuristic, "width": td.width, "bags": len(td), "annotated": annotated}
    if len(joint) == 0:
        return Schedule([], algorithm="twremat", options=options)
    algo = _TWRemat(joint, td, k)
    algo.run(_Piece(list(range(len(td))), frozenset(range(len(joint)))), {joint.final})
    options["calls"] = algo.calls
    logger.debug("TWRemat(k=%d): width %d, %d bags, %d calls, %d ops", k, td.width, len(td), algo.calls,
                 len(algo.ops))
    if annotated:
        return Schedule(algo.ops, algorithm="twremat", options=options)
    return with_liveness_frees(joint, (op.node for op in algo.ops if op.action == COMPUTE),
                               algorithm="twremat", options=options)
