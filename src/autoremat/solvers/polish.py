"""Local repair of ``auto``'s plan: move, merge and flip segment boundaries (issue 28).

On seeded random U-Nets the best plan ``auto`` found at 50 % recomputed 1.06-1.24x what the
best plan known did (``benchmarks/results/cpu/optimum_gaps/random/``), and the better plans were
not of another kind: the same few recomputed segments over contiguous stretches of the
topological order, with their boundaries a few nodes elsewhere (e.g. a 95-node U-Net:
``dp-approx`` recomputes [0-9] [10-78] [79-86] and keeps [87-94]; ``milp`` recomputes [0-11]
[12-81] and keeps [82-94], 17 % less recomputation). ``dp-approx`` does not reach them because its
lower-set family and its memory model are approximations.

:func:`polish` is a hill climb on such a plan with the one cost model as the judge: each move is
simulated (:func:`autoremat.cost.simulate`, the solvers' objective: without replay tails) and kept
when the plan still fits the budget and recomputes less; the moves are merging two neighbouring
segments, making a recomputed segment plain, and shifting one boundary by 1, 2, 4 or 8 nodes.
First improvement wins; it stops when no move improves or after :data:`POLISH_MAX_TRIALS`
simulations.

Decisions (tested in ``tests/solvers/test_polish.py``):

* Boundaries move along the plan's own order (its segments in turn, each in node order: a
  topological order, so every prefix is a lower set); until issue 28's second pass only plans of
  contiguous node-id ranges were polished, which left out every ``dp-approx`` plan on a graph with
  branches (ResNet-50's downsample paths). A move the runtime cannot execute
  (:func:`autoremat.plan.validate_plan`: e.g. recomputing ops inside a module-level block captured
  op by op) is skipped; plans with selective saves (``keep``) or offloads are returned as they are.
* Graphs of at most :data:`POLISH_MAX_NODES` nodes (a simulation costs about 2-5 ms at 100 nodes
  here), deterministic times only (like the lattice search :mod:`.milp.exact`: on measured times
  a move that wins by timing noise would change the plan from capture to capture).
* The result is never worse than the input: the caller finalises it (replay tails, the budget
  check) and keeps the input where that fails or is not faster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ..cost import simulate
from ..graph import Graph
from ..plan import Plan, Segment, validate_plan

__all__ = ["polish", "plan_order", "POLISH_MAX_NODES", "POLISH_MAX_TRIALS"]

logger = logging.getLogger(__name__)

POLISH_MAX_NODES = 300
""":func:`polish` leaves larger graphs as they are."""

POLISH_MAX_TRIALS = 120
"""At most this many simulated moves per :func:`polish` call."""

_SHIFTS = (1, -1, 2, -2, 3, -3, 4, -4, 6, -6, 8, -8, 12, -12, 16, -16)


def plan_order(graph: Graph, plan: Plan) -> tuple[int, ...] | None:
    """``plan``'s segments in turn, each in node order, where that is a topological order of
    ``graph`` covering it once (then every prefix is a lower set and each segment a range of it);
    else ``None``."""
    order = tuple(v for seg in plan.segments for v in seg.nodes)
    if sorted(order) != list(range(len(graph))):
        return None
    pos = {v: i for i, v in enumerate(order)}
    return None if any(pos[u] > pos[v] for v in graph.nodes for u in graph.pred(v)) else order


def _ranges(graph: Graph, plan: Plan) -> tuple[tuple[int, ...], list[int], list[bool]] | None:
    """``(order, starts, recompute flags)``: ``plan``'s order (its segments in turn, each in node
    order) and where each segment starts in it, where the segments cover the graph once, else
    ``None``. Each segment is the difference of two lower sets and node ids are a topological
    order, so every prefix of that order is a lower set: a boundary moved along it keeps one."""
    if plan.offloads or any(s.keep for s in plan.segments) or any(not s.nodes for s in plan.segments):
        return None
    order = plan_order(graph, plan)
    if order is None:
        return None
    starts, at = [], 0
    for seg in plan.segments:
        starts.append(at)
        at += len(seg.nodes)
    return order, starts, [bool(seg.recompute) for seg in plan.segments]


def _plan_of(order: tuple[int, ...], starts: list[int], flags: list[bool]) -> Plan:
    ends = starts[1:] + [len(order)]
    return Plan([Segment(order[a:b], recompute=f) for a, b, f in zip(starts, ends, flags)])


def _moves(n: int, starts: list[int], flags: list[bool]) -> Iterator[tuple[list[int], list[bool]]]:
    """Neighbouring plans: merges, flips to plain, then boundary shifts (module docstring)."""
    for i in range(1, len(starts)):  # merge segment i into i - 1 (recomputed if either was)
        yield starts[:i] + starts[i + 1:], flags[:i - 1] + [flags[i - 1] or flags[i]] + flags[i + 1:]
    for i, f in enumerate(flags):
        if f:
            yield starts, flags[:i] + [False] + flags[i + 1:]
    for d in _SHIFTS:
        for i in range(1, len(starts)):
            s = starts[i] + d
            hi = starts[i + 1] if i + 1 < len(starts) else n
            if starts[i - 1] < s < hi:
                yield starts[:i] + [s] + starts[i + 1:], flags


def polish(graph: Graph, plan: Plan, budget_bytes: int) -> Plan | None:
    """A plan of ``plan``'s form (module docstring) that fits ``budget_bytes`` and recomputes
    less than ``plan`` by the simulator, or ``None`` where no move improves it (or the plan or
    graph is not of the form polished). The plan returned is bare: the caller finalises it."""
    if len(graph) > POLISH_MAX_NODES:
        return None
    form = _ranges(graph, plan)
    if form is None:
        return None
    n = len(graph)
    order, starts, flags = form
    best = simulate(graph, _plan_of(order, starts, flags), check=False, record=False).extra_time_s
    trials = moved = 0
    improved = True
    while improved and trials < POLISH_MAX_TRIALS:
        improved = False
        for cand_starts, cand_flags in _moves(n, starts, flags):
            trials += 1
            cand = _plan_of(order, cand_starts, cand_flags)
            try:
                validate_plan(graph, cand)  # e.g. a module-level op no runtime region can wrap
            except ValueError:
                continue
            sim = simulate(graph, cand, check=False, record=False)
            if sim.peak_bytes <= budget_bytes and sim.extra_time_s < best * (1 - 1e-9):
                starts, flags, best, improved = cand_starts, cand_flags, sim.extra_time_s, True
                moved += 1
                break
            if trials >= POLISH_MAX_TRIALS:
                break
    if not moved:
        return None
    logger.debug("polish: %d moves in %d simulations, extra time %.6g s", moved, trials, best)
    out = _plan_of(order, starts, flags)
    out.options = {"polished_moves": moved}
    return out
