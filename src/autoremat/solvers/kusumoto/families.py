"""The lower-set families the Kusumoto DP runs over (Kusumoto et al. §4.2, §4.3).

.. [1] M. Kusumoto, T. Inoue, G. Watanabe, T. Akiba, M. Koyama, "A Graph Theoretic Framework of
   Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019.

:func:`all_lower_sets` enumerates every lower set (``dp-exact``; exponential in the width of the
graph, so it stops at a limit) and :func:`pruned_lower_sets` the pruned family
``{L^v : v ∈ V} ∪ {∅, V}`` (``dp-approx``; ``n + 2`` sets at most). Both as bitsets, in order
of size.

Module-level graphs (:attr:`~autoremat.graph.Graph.in_program_order`): the runtime cannot reorder
the user's ``forward``, so a plan runs its nodes in id order whatever its segments say; a lower
set that is not an id prefix (``{pw.3}`` before ``{sp.3}`` in a Fourier layer whose two branches
read one input) would be simulated in an order the step never runs (measured on such a network:
predicted 0.93x of the unpatched peak, measured 1.00x). Both families are the id prefixes there.
"""

from __future__ import annotations

from ...cost.bitsets import GraphBits, bits

__all__ = ["all_lower_sets", "pruned_lower_sets"]


def all_lower_sets(p: GraphBits, limit: int) -> list[int] | None:
    """Every lower set as a bitset, in order of size; ``None`` when there are more than ``limit``.
    At module level (:attr:`~autoremat.graph.Graph.in_program_order`) the id prefixes."""
    if p.module_mode:
        return _prefixes(p) if p.n + 1 <= limit else None
    sources = sum(p.bit[v] for v in range(p.n) if not p.pred[v])
    out = [0]
    frontier: list[tuple[int, int]] = [(0, sources)]  # (lower set, nodes that can join it)
    seen = {0}
    while frontier:
        nxt: list[tuple[int, int]] = []
        for mask, addable in frontier:
            for v in bits(addable):
                child = mask | p.bit[v]
                if child in seen:
                    continue
                seen.add(child)
                if len(seen) > limit:
                    return None
                grow = addable & ~p.bit[v]
                for w in p.succ[v]:
                    if p.predmask[w] & ~child == 0:
                        grow |= p.bit[w]
                nxt.append((child, grow))
                out.append(child)
        frontier = nxt
    return out


def pruned_lower_sets(p: GraphBits) -> list[int]:
    """Kusumoto §4.3: ``{L^v : v ∈ V} ∪ {∅, V}`` where ``L^v`` is ``v`` and its ancestors (at module
    level the id prefix ending at ``v``: the forward runs in the program's order)."""
    if p.module_mode:
        return _prefixes(p)
    anc = [0] * p.n
    for v in range(p.n):
        mask = p.bit[v]
        for u in p.pred[v]:
            mask |= anc[u]
        anc[v] = mask
    return sorted(set(anc) | {0, p.full}, key=lambda m: m.bit_count())


def _prefixes(p: GraphBits) -> list[int]:
    """The id prefixes ``{0..k-1}``, ``k = 0..n``: every lower set of a module-level graph (module docstring)."""
    return [(1 << k) - 1 for k in range(p.n + 1)]
