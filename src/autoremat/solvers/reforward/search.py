"""Re-forwarding's search (Feng & Huang, Algorithm 1 on chains of splitting vertices, Algorithm 5).

For every candidate max term, in decreasing order with the paper's skipping rule, the
division tree is expanded where a closed set costs more than the term and the chains of
type-1 nodes are solved by the accessibility-graph shortest path (a sliding-window minimum).
See :mod:`autoremat.solvers.reforward`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .tree import ClosedSet, TreeModel

__all__ = ["ReforwardSolution", "ChainPre", "chain_pre", "max_terms", "solution_family"]

_INF = math.inf


@dataclass(frozen=True)
class ReforwardSolution:
    """One solution of the paper's search: what is kept and what is re-forwarded together."""

    max_term_bytes: int
    """The max term ``m`` of the loop that produced it (every segment costs at most ``m``)."""
    kept: tuple[int, ...]
    """Kept vertices (node ids); the virtual source and sink are not listed."""
    groups: tuple[tuple[int, ...], ...]
    """Node ids of each re-forwarded segment interior."""
    kept_bytes: int
    """First term of Eqn. 1: ``Σ keep(v)`` over the kept vertices."""
    reforward_bytes: int
    """Second term of Eqn. 1: the largest ``inner`` cost of a re-forwarded segment."""
    multi_input: str = "store"
    """The multi-input remedy of the family it belongs to (``"store"`` or ``"merge"``)."""

    @property
    def cost_bytes(self) -> int:
        """Eqn. 1 of the paper: kept bytes plus the largest re-forward."""
        return self.kept_bytes + self.reforward_bytes


# ====================================================================== Algorithm 1 / 5
class ChainPre:
    """Per type-1 node: prefix sums over the chain of splitting vertices."""

    __slots__ = ("p", "mcost", "pm", "ps", "keep", "pinned", "masks")

    def __init__(self, M: TreeModel, node: ClosedSet) -> None:
        chain = node.chain
        p = self.p = len(chain) - 1
        self.mcost = [0.0] + [0 if m is None else m.cost for m in node.members]
        self.masks = [0] + [0 if m is None else m.mask for m in node.members]
        pm = [0] * (p + 1)
        for a in range(1, p + 1):
            c = self.mcost[a]
            pm[a] = pm[a - 1] + (0 if c == _INF else int(c))
        ps = [0] * (p + 1)
        self.pinned = [False] * (p + 1)
        for y in range(1, p):
            x = chain[y]
            self.pinned[y] = x in M.pinned
            ps[y] = ps[y - 1] + (0 if self.pinned[y] else M.inner[x])
        ps[p] = ps[p - 1] if p >= 1 else 0
        self.pm = pm
        self.ps = ps
        self.keep = [0] + [M.keep[chain[y]] for y in range(1, p)] + [0]

    def run_cost(self, a: int, b: int) -> int:
        """``inner`` cost of re-forwarding members ``a+1..b`` and the splits between."""
        return self.pm[b] - self.pm[a] + self.ps[b - 1] - self.ps[a]


def chain_pre(M: TreeModel, node: ClosedSet) -> ChainPre:
    if node._pre is None:
        node._pre = ChainPre(M, node)
    return node._pre


def _shortest_path(pre: ChainPre, m: float, expanded: list[bool]) -> list[int]:
    """Shortest source→target path of the accessibility graph for max term ``m``.

    Vertex weights ``keep``; ``a → b`` exists iff members ``a+1..b`` are not expanded,
    no pinned split lies strictly between and the run costs at most ``m``; an expanded
    member ``b`` only links ``b-1 → b``. Edges into ``b`` come from a contiguous range of
    ``a`` that only moves right, so a monotone deque gives the minimum. Returns the
    parent of each chain position on the path (``-1`` off the path).
    """
    p = pre.p
    dist = [0] * (p + 1)
    parent = [-1] * (p + 1)
    dq: list[int] = [0]  # indices with increasing dist (a list used as a deque)
    head = 0
    lo = 0  # smallest admissible a for the current b
    for b in range(1, p + 1):
        if expanded[b]:
            best_a = b - 1
            lo = b - 1
        else:
            while lo < b - 1 and pre.run_cost(lo, b) > m:
                lo += 1
            while head < len(dq) and dq[head] < lo:
                head += 1
            best_a = dq[head] if head < len(dq) else b - 1
            if pre.run_cost(best_a, b) > m and best_a != b - 1:  # pragma: no cover - invariant
                raise AssertionError("re-forward window broken, please report")
        dist[b] = dist[best_a] + pre.keep[b]
        parent[b] = best_a
        if expanded[b] or pre.pinned[b]:
            # nothing may jump over an expanded member or a pinned split
            dq = [b]
            head = 0
            lo = b
        else:
            while len(dq) > head and dist[dq[-1]] >= dist[b]:
                dq.pop()
            dq.append(b)
    return parent


class _Rec:
    """Collects the re-forwarded interiors (bitsets) of one solution."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[int] = []


def _solve(M: TreeModel, node: ClosedSet, m: float, rec: _Rec | None) -> tuple[int, float]:
    """Algorithm 5 on a closed set that must be expanded (``node.cost > m``).

    Returns the kept bytes strictly inside ``node`` and the largest re-forward used.
    """
    if node.kind == 1:
        pre = chain_pre(M, node)
        p = pre.p
        expanded = [False] + [pre.mcost[a] > m for a in range(1, p + 1)]
        kept = 0
        mx = 0.0
        sub: dict[int, tuple[int, float]] = {}
        for a in range(1, p + 1):
            if expanded[a]:
                child = node.members[a - 1]
                assert child is not None, "edge member expanded, please report"
                sub[a] = _solve(M, child, m, rec)
        parent = _shortest_path(pre, m, expanded)
        b = p
        while b > 0:
            a = parent[b]
            if b in sub and a == b - 1:
                k, x = sub[b]
                kept += k
                mx = max(mx, x)
            else:
                mx = max(mx, pre.run_cost(a, b))
                if rec is not None:
                    g = 0
                    for c in range(a + 1, b + 1):
                        g |= pre.masks[c]
                    for y in range(a + 1, b):
                        g |= 1 << node.chain[y]
                    if g:
                        rec.groups.append(g)
            if a > 0:
                kept += pre.keep[a]
            b = a
        return kept, mx
    kept = node.ends_keep if node.kind == 3 else 0
    mx = 0.0
    for ch in node.children:
        if ch.cost <= m:
            mx = max(mx, ch.cost)
            if rec is not None:
                rec.groups.append(ch.mask)
        else:
            k, x = _solve(M, ch, m, rec)
            kept += k
            mx = max(mx, x)
    return kept, mx


def max_terms(M: TreeModel, root: ClosedSet) -> list[int]:
    """Candidate max terms, decreasing: costs of the tree's nodes and of type-1 runs."""
    terms: set[int] = {0}
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.cost != _INF:
            terms.add(int(node.cost))
        if node.kind == 1:
            pre = chain_pre(M, node)
            for a in range(pre.p):
                for b in range(a + 1, pre.p + 1):
                    if pre.mcost[b] == _INF or (b > a + 1 and pre.pinned[b - 1]):
                        break
                    terms.add(pre.run_cost(a, b))
    return sorted(terms, reverse=True)


def solution_family(M: TreeModel, root: ClosedSet, terms: list[int], mode: str) -> list[ReforwardSolution]:
    """The loop of Algorithm 5 (and 1) over the max terms, with the skipping rule."""
    asc = terms[::-1]
    out: list[ReforwardSolution] = []
    i = 0
    while i < len(terms):
        m = terms[i]
        rec = _Rec()
        if root.cost <= m:
            kept, mx = 0, root.cost
            rec.groups.append(root.mask)
        else:
            kept, mx = _solve(M, root, m, rec)
        out.append(_solution(M, m, kept, mx, rec, mode))
        # every candidate in [mx, m] has this same solution: continue below mx
        i = len(terms) - bisect.bisect_left(asc, mx)
    return out


def _solution(M: TreeModel, m: int, kept: int, mx: float, rec: _Rec, mode: str) -> ReforwardSolution:
    groups = tuple(M.nodes_of(g) for g in sorted(rec.groups, key=lambda g: g & -g) if g)
    interior = 0
    for g in rec.groups:
        interior |= g
    kept_nodes = tuple(v for v in range(M.n) if not interior >> (v + 1) & 1)
    return ReforwardSolution(max_term_bytes=int(m), kept=kept_nodes, groups=groups, kept_bytes=int(kept),
                             reforward_bytes=int(mx), multi_input=mode)
