"""Brute force over canonical strategies: the test oracle of the DP solvers.

Problem: the general recomputation problem of Kusumoto et al. [1]_ (§3): among all increasing
sequences of lower sets ``L1 ⊂ L2 ⊂ … ⊂ Lk = V``, each run as the plan
:func:`~autoremat.plan.segments_from_lower_sets` builds from it, find one whose simulated step
peak fits the budget with the least extra (recomputation) time.

Method: the naive exhaustive search of [1]_ §4.1. Every lower set is enumerated, every chain
from ∅ to V is walked depth-first, and every plan is judged by
:func:`autoremat.cost.simulate` (no model of its own, so it shares no code, and no
approximation, with the DP solvers it checks). Ties on extra time go to the lower peak, then to
fewer segments.

.. [1] M. Kusumoto, T. Inoue, G. Watanabe, T. Akiba, M. Koyama, "A Graph Theoretic Framework
   of Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019.

Complexity: the number of chains of lower sets, which is up to the ordered Bell number of
``n`` (47 293 for 7 independent nodes, 7 087 261 for 9), times one O(n + e) simulation each;
space O(#lower sets). Exact (for the plans ``segments_from_lower_sets`` can express). Small
graphs only: more than ``max_nodes`` nodes (default 12) or more than ``max_sequences``
chains (default 2 000 000) is a ``ValueError``.

It is not registered in :data:`autoremat.solvers.SOLVERS`: it exists to check the other
solvers in tests, and would never finish on a real model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, segments_from_lower_sets
from ...cost import simulate

__all__ = ["solve_bruteforce", "lower_set_chains"]

_DEFAULTS: dict[str, int] = {"max_nodes": 12, "max_sequences": 2_000_000}


def lower_set_chains(graph: Graph) -> Iterator[list[frozenset[int]]]:
    """Every increasing sequence of non-empty lower sets ending in V (none for an empty graph)."""
    n = len(graph)
    if n == 0:
        return
    full = frozenset(graph.nodes)
    sets = [frozenset(s) for s in graph.lower_sets() if s]
    bigger = {s: [t for t in sets if s < t] for s in sets}
    firsts = sets

    def walk(prefix: list[frozenset[int]], options: list[frozenset[int]]) -> Iterator[list[frozenset[int]]]:
        for nxt in options:
            chain = prefix + [nxt]
            if nxt == full:
                yield chain
            else:
                yield from walk(chain, bigger[nxt])

    yield from walk([], firsts)


def solve_bruteforce(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | None = None) -> Plan:
    """The plan with the least extra time whose simulated peak fits ``budget_bytes``.

    Raises :class:`~autoremat.errors.InfeasibleBudgetError` with the least simulated peak of
    all plans when none fits; ``ValueError`` when the graph is too big to enumerate.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be an int >= 0 (bytes of step peak)")
    unknown = set(config or {}) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"bruteforce: unknown option(s) {sorted(unknown)}; accepted: {sorted(_DEFAULTS)}")
    cfg = {**_DEFAULTS, **(config or {})}
    n = len(graph)
    if n > cfg["max_nodes"]:
        raise ValueError(f"bruteforce enumerates every lower-set chain; the graph has {n} nodes, "
                         f"more than max_nodes={cfg['max_nodes']} (use dp-exact or dp-approx)")
    if n == 0:
        return Plan([], solver="bruteforce", options={"sequences": 0})
    best: tuple[float, int, int] | None = None
    best_plan: Plan | None = None
    least_peak: int | None = None
    count = 0
    for chain in lower_set_chains(graph):
        count += 1
        if count > cfg["max_sequences"]:
            raise ValueError(f"bruteforce: more than max_sequences={cfg['max_sequences']} lower-set "
                             "chains; the graph is too wide to enumerate")
        plan = Plan(segments_from_lower_sets(graph, chain), solver="bruteforce")
        sim = simulate(graph, plan, check=False, record=False)
        if least_peak is None or sim.peak_bytes < least_peak:
            least_peak = sim.peak_bytes
        if sim.peak_bytes > budget_bytes:
            continue
        key = (sim.extra_time_s, sim.peak_bytes, len(plan.segments))
        if best is None or key < best:
            best, best_plan = key, plan
    if best_plan is None:
        raise InfeasibleBudgetError(budget_bytes, least_peak, solver="bruteforce")
    best_plan.options = {"sequences": count}
    return best_plan
