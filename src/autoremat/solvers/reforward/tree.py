"""Re-forwarding's vertex model and division tree (Feng & Huang, Algorithms 2-4).

The graph with a virtual source and sink and the two costs of a vertex (``keep``, ``inner``),
closed sets, splitting vertices, branches and maximal splits, and the division tree built
top-down from the whole graph. See :mod:`autoremat.solvers.reforward` for the method and the
decisions taken where the paper is ambiguous.
"""

from __future__ import annotations

import math
from typing import Any

from ...graph import Graph

__all__ = ["TreeModel", "ClosedSet", "build_tree", "breaks_multi_input_assumption"]

_INF = math.inf


# ====================================================================== internal model
def _bits(x: int) -> list[int]:
    """Indices of the set bits of ``x``, increasing."""
    if x.bit_count() <= 12:
        out: list[int] = []
        while x:
            low = x & -x
            out.append(low.bit_length() - 1)
            x ^= low
        return out
    s = bin(x)[:1:-1]
    out = []
    i = s.find("1")
    while i >= 0:
        out.append(i)
        i = s.find("1", i + 1)
    return out


class TreeModel:
    """The graph with a virtual source 0 and sink N-1; node ``v`` is vertex ``v + 1``."""

    def __init__(self, graph: Graph, pins_multi_input: bool) -> None:
        """Long by design: the vertex model of §3 (the paper's ``l(v)``, edges and the multi-input
        remedies) is built in one pass over the graph."""
        n = len(graph)
        self.n = n
        N = self.N = n + 2
        self.sink = N - 1
        succ: list[list[int]] = [[] for _ in range(N)]
        pred: list[list[int]] = [[] for _ in range(N)]
        for v in graph.nodes:
            x = v + 1
            ps = graph.pred(v)
            if not ps:
                succ[0].append(x)
                pred[x].append(0)
            for u in ps:
                pred[x].append(u + 1)
            for w in graph.succ(v):
                succ[x].append(w + 1)
            if not graph.succ(v) or graph.held_to_loss(v):
                succ[x].append(N - 1)
                pred[N - 1].append(x)
        if n == 0:
            succ[0].append(1)
            pred[1].append(0)
        self.succ = succ
        self.pred = pred
        self.succmask = [sum(1 << w for w in s) for s in succ]
        self.predmask = [sum(1 << u for u in p) for p in pred]
        anc = [0] * N
        for x in range(N):
            a = 0
            for u in pred[x]:
                a |= anc[u] | (1 << u)
            anc[x] = a
        desc = [0] * N
        for x in range(N - 1, -1, -1):
            d = 0
            for w in succ[x]:
                d |= desc[w] | (1 << w)
            desc[x] = d
        self.anc = anc
        self.desc = desc

        # what each node's backward keeps, by vertex (views: the storage they live in too)
        saved_by: list[set[int]] = [set() for _ in range(N)]
        saves: list[set[int]] = [set() for _ in range(N)]
        for v in graph.nodes:
            d = graph.node(v)
            if not d["requires_grad"]:
                continue
            for u in d["saves"]:
                for s in {u, graph.root(u)}:
                    saves[v + 1].add(s + 1)
                    saved_by[s + 1].add(v + 1)
        for u in graph.meta.get("loss_saves", []):
            for s in {int(u), graph.root(int(u))}:
                saved_by[s + 1].add(N - 1)
        self.saves = [sorted(s - {x}) for x, s in enumerate(saves)]

        keep = [0] * N
        inner = [0] * N
        for v in graph.nodes:
            d = graph.node(v)
            keep[v + 1] = int(graph.node(graph.root(v))["alloc_bytes"])
            held = int(d["alloc_bytes"]) if saved_by[v + 1] else 0
            extra = int(d["extra_saved_bytes"]) if d["requires_grad"] else 0
            inner[v + 1] = held + extra
        self.keep = keep
        self.inner = inner

        pinned: set[int] = set()
        for v in graph.nodes:
            x = v + 1
            if not graph.node(v)["recomputable"]:
                pinned.add(x)
                pinned.update(self.saves[x])
            elif pins_multi_input and _breaks(graph, v):
                pinned.update(s + 1 for s in _saved_inputs(graph, v))
        pinned.discard(0)
        pinned.discard(N - 1)
        self.pinned = pinned
        self.pinned_mask = sum(1 << x for x in pinned)

    def has_edge(self, a: int, b: int) -> bool:
        return bool(self.succmask[a] >> b & 1)

    def cost(self, mask: int) -> float:
        """``inner`` cost of re-forwarding the vertices of ``mask`` together."""
        if mask & self.pinned_mask:
            return _INF
        return sum(self.inner[x] for x in _bits(mask))

    def nodes_of(self, mask: int) -> tuple[int, ...]:
        return tuple(x - 1 for x in _bits(mask))


def _saved_inputs(graph: Graph, v: int) -> set[int]:
    """Predecessors of ``v`` (or the storages they live in) that ``v``'s backward keeps."""
    d = graph.node(v)
    if not d["requires_grad"]:
        return set()
    saved = {s for u in d["saves"] for s in (u, graph.root(u))}
    return {s for u in graph.pred(v) for s in (u, graph.root(u)) if s in saved and s != v}


def _breaks(graph: Graph, v: int) -> bool:
    return len(graph.pred(v)) >= 2 and bool(_saved_inputs(graph, v))


def breaks_multi_input_assumption(graph: Graph) -> list[int]:
    """Nodes with two or more inputs whose backward saves one of them (assumption 2 of [1])."""
    return [v for v in graph.nodes if _breaks(graph, v)]


# ====================================================================== division tree
class ClosedSet:
    """A closed set ``[s_ij]``: head, tail, interior bitset (internal vertex ids)."""

    __slots__ = ("head", "tail", "mask", "verts", "has_edge", "kind", "children", "chain",
                 "members", "ends_mask", "ends_keep", "cost", "_pre")

    def __init__(self, head: int, tail: int, mask: int, verts: list[int], has_edge: bool) -> None:
        self.head = head
        self.tail = tail
        self.mask = mask
        self.verts = verts
        self.has_edge = has_edge
        self.kind = 0
        self.children: list[ClosedSet] = []
        self.chain: list[int] = []
        self.members: list[ClosedSet | None] = []
        self.ends_mask = 0
        self.ends_keep = 0
        self.cost: float = 0
        self._pre: Any = None


def _components(M: TreeModel, mask: int, verts: list[int]) -> list[list[int]]:
    """Connected components (undirected) of the subgraph induced on ``mask``."""
    seen = 0
    comps: list[list[int]] = []
    for s in verts:
        if seen >> s & 1:
            continue
        seen |= 1 << s
        comp = [s]
        stack = [s]
        while stack:
            x = stack.pop()
            for y in M.succ[x] + M.pred[x]:
                if mask >> y & 1 and not seen >> y & 1:
                    seen |= 1 << y
                    comp.append(y)
                    stack.append(y)
        comp.sort()
        comps.append(comp)
    return comps


def _splitting_vertices(M: TreeModel, node: ClosedSet) -> list[int]:
    """Algorithm 2 for every vertex at once: ``t`` splits ``[s_ij]`` iff no edge jumps over it."""
    mask = node.mask
    pending: dict[int, int] = {}
    open_edges = 0
    for w in M.succ[node.head]:
        if mask >> w & 1:
            pending[w] = pending.get(w, 0) + 1
            open_edges += 1
    out: list[int] = []
    for t in node.verts:
        open_edges -= pending.pop(t, 0)
        s = M.succ[t]
        for w in s:
            pending[w] = pending.get(w, 0) + 1
        open_edges += len(s)
        if open_edges == len(s):
            out.append(t)
    return out


def _frontier(vertices: int, neighbours: list[int], closed: int) -> int:
    """The vertices of ``vertices`` with a neighbour outside ``closed`` (bitsets)."""
    out = 0
    for v in _bits(vertices):
        if neighbours[v] & ~closed:
            out |= 1 << v
    return out


def _maximal_split(M: TreeModel, node: ClosedSet) -> list[ClosedSet]:
    """Algorithm 4: the members with an interior of the maximal split of a type-3 set.

    For every vertex pair ``(k, t)`` of ``[s_ij]`` the largest closed set ``s_kt`` is the
    union of the connected components of ``desc(k) ∩ anc(t)`` that have no edge leaving
    ``s_kt ∪ {k, t}`` (Definition 1; the paper's Algorithm 4 tests only the whole set).
    The members are the closed sets contained in no larger proper one (Lemma 6), found by
    taking the candidates by decreasing size and keeping those whose interior is disjoint
    from the members already kept.
    """
    i, j, S = node.head, node.tail, node.mask
    pts = [i] + node.verts + [j]
    ptmask = S | (1 << i) | (1 << j)
    anc, desc, predmask, succmask = M.anc, M.desc, M.predmask, M.succmask
    # X[k]: interior vertices below k with a predecessor not below k (or k);
    # Y[t]: interior vertices above t with a successor not above t (or t).
    X: dict[int, int] = {}
    Y: dict[int, int] = {}
    for k in pts:
        X[k] = _frontier(desc[k] & S, predmask, desc[k] | (1 << k))
        Y[k] = _frontier(anc[k] & S, succmask, anc[k] | (1 << k))
    cands: list[tuple[int, int, int, int]] = []
    for k in pts[:-1]:
        dk = desc[k] & S
        if not dk:
            continue
        xk = X[k]
        sk = succmask[k]
        for t in _bits(desc[k] & ptmask):
            if k == i and t == j:
                continue
            B = dk & anc[t]
            if not B:
                continue
            Z = xk | Y[t]
            if B & Z:
                # only part of B may be independent: every component of B holds a successor
                # of k and a predecessor of t, so two components need two of each
                ok = B & ~Z
                if not (sk & ok and predmask[t] & ok and (sk & B).bit_count() > 1
                        and (predmask[t] & B).bit_count() > 1):
                    continue
                reach = B & Z
                frontier = reach
                while frontier:
                    nb = 0
                    for x in _bits(frontier):
                        nb |= succmask[x] | predmask[x]
                    frontier = nb & B & ~reach
                    reach |= frontier
                B &= ~reach
                if not B:
                    continue
            cands.append((-B.bit_count(), k, t, B))
    cands.sort()
    owned = 0
    members: list[ClosedSet] = []
    for _, k, t, B in cands:
        if B & owned:
            continue
        owned |= B
        members.append(ClosedSet(k, t, B, list(_bits(B)), M.has_edge(k, t)))
    return members


def build_tree(M: TreeModel) -> ClosedSet:
    """The division tree (Definition 9), top-down from the whole graph."""
    full = sum(1 << x for x in range(1, M.N - 1))
    root = ClosedSet(0, M.N - 1, full, list(range(1, M.N - 1)), M.has_edge(0, M.N - 1))
    stack = [root]
    order: list[ClosedSet] = []
    while stack:
        node = stack.pop()
        order.append(node)
        _divide(M, node)
        stack.extend(node.children)
    for node in reversed(order):  # children first
        node.cost = M.cost(node.mask)
    return root


def _divide(M: TreeModel, node: ClosedSet) -> None:
    if not node.verts:
        node.kind = 0
        return
    if node.has_edge:
        node.kind = 2
        node.children = [ClosedSet(node.head, node.tail, sum(1 << x for x in c), c, False)
                         for c in _components(M, node.mask, node.verts)]
        return
    splits = _splitting_vertices(M, node)
    if splits:
        node.kind = 1
        chain = [node.head] + splits + [node.tail]
        node.chain = chain
        pos = {x: p for p, x in enumerate(node.verts)}
        bounds = [-1] + [pos[s] for s in splits] + [len(node.verts)]
        for a in range(len(chain) - 1):
            part = node.verts[bounds[a] + 1:bounds[a + 1]]
            if part:
                child = ClosedSet(chain[a], chain[a + 1], sum(1 << x for x in part), part,
                                M.has_edge(chain[a], chain[a + 1]))
                node.members.append(child)
                node.children.append(child)
            else:
                node.members.append(None)
        return
    comps = _components(M, node.mask, node.verts)
    if len(comps) > 1:
        node.kind = 2
        node.children = [ClosedSet(node.head, node.tail, sum(1 << x for x in c), c, False) for c in comps]
        return
    node.kind = 3
    node.children = _maximal_split(M, node)
    covered = 0
    for ch in node.children:
        covered |= ch.mask
    node.ends_mask = node.mask & ~covered
    node.ends_keep = sum(M.keep[x] for x in _bits(node.ends_mask))
