"""``"chen"``: Chen et al.'s sublinear-memory segmentation, generalised to DAGs, under a budget.

Problem: split the graph into segments along the execution order so that, keeping only each
segment's outputs and recomputing its inside once in backward, the step fits the budget.

Paper: .. [1] T. Chen, B. Xu, C. Zhang, C. Guestrin, "Training Deep Nets with Sublinear
   Memory Cost", arXiv:1604.06174, 2016 (Algorithm 3, "memory planning with budget"),
   as configured by .. [2] M. Kusumoto et al., "A Graph Theoretic Framework of Recomputation
   Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019, Appendix B.

Method. Candidate split points ``C`` (Kusumoto Appendix B: nodes whose removal disconnects
the graph, i.e. articulation points) are taken, for a DAG in execution order, as the nodes
``v`` whose prefix ``{0..v}`` has boundary exactly ``{v}``: then the prefix is a lower set
and cutting after ``v`` keeps a single tensor, which is what an articulation point between
two parts of a network means. For a threshold ``b`` Algorithm 3 walks the execution order,
accumulating the bytes each node saves for backward, and cuts after a candidate once the
accumulated size exceeds ``b``. Chen's paper searches ``b`` for the least memory; under a
budget we try ``b`` over a geometric grid (``thresholds`` values, default 48, between the smallest
and the total saved bytes, plus 0 and the √n split) and every plan is judged by
:func:`autoremat.simulate`: the plan that fits with the least recomputation wins (the plan
without recomputation is a candidate too, so a budget that does not bind recomputes nothing).

Module-level graphs can only recompute single module calls (a block captured op by op, the
default, as its whole call region: :meth:`~autoremat.graph.Graph.recompute_units`): there the
variant checkpoints those calls in decreasing order of saved bytes per second of recomputation;
every prefix of that order is simulated and the cheapest one that fits wins.

Time O(thresholds · n) simulations of O(n + e) each; space O(n). Heuristic (not optimal).
Infeasible budgets raise with ``min_budget_bytes`` = the least simulated peak among all the
plans tried.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, Segment, segments_from_lower_sets
from ..cost import no_recompute_plan, simulate
from ._config import SolverConfig
from .content_keys import signature

__all__ = ["solve_chen", "min_budget_chen", "chen_plans", "split_candidates", "segment_by_threshold", "ChenConfig"]


def split_candidates(graph: Graph) -> list[int]:
    """Nodes after which the execution-order prefix has a single boundary node."""
    return [v for v in graph.prefix_cuts() if graph.succ(v)]


def segment_by_threshold(graph: Graph, threshold: float, candidates: set[int]) -> list[list[int]]:
    """Chen's Algorithm 3: cut after a candidate once the accumulated saved bytes exceed ``threshold``."""
    lower_sets: list[list[int]] = []
    acc = 0.0
    for v in graph.nodes:
        acc += graph.node(v)["saved_bytes"]
        if v in candidates and acc > threshold and v != len(graph) - 1:
            lower_sets.append(list(range(v + 1)))
            acc = 0.0
    lower_sets.append(list(graph.nodes))
    return lower_sets


@dataclass(frozen=True)
class ChenConfig(SolverConfig):
    """Options of ``chen``."""

    solver: ClassVar[str] = "chen"
    renamed: ClassVar[dict[str, str]] = {"grid": "thresholds"}
    thresholds: int = field(default=48, metadata={"help": "thresholds tried on a geometric grid between the least "
                                                          "saved bytes of a node and the total (Algorithm 3's b)"})


def solve_chen(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | ChenConfig | None = None) -> Plan:
    return _pick(chen_plans(graph, _thresholds(config)), budget_bytes, "chen")


def min_budget_chen(graph: Graph, *, config: dict[str, Any] | ChenConfig | None = None) -> int:
    """The least budget :func:`solve_chen` meets: the least simulated peak of the plans it tries
    (it meets a budget exactly when one of them fits it), from one pass over them."""
    return min(peak for peak, _t, _p in chen_plans(graph, _thresholds(config)))


def _thresholds(config: dict[str, Any] | ChenConfig | None) -> int:
    grid = ChenConfig.parse(config).thresholds
    if isinstance(grid, bool) or not isinstance(grid, int):
        raise ValueError(f"thresholds={grid!r} must be an int >= 1")
    if grid < 1:
        raise ValueError(f"thresholds={grid} must be >= 1")
    return grid


def chen_plans(graph: Graph, thresholds: int = 48) -> list[tuple[int, float, Plan]]:
    """``(simulated peak, extra time, plan)`` of every plan Chen's method tries on ``graph`` (the
    plan without recomputation first): :func:`solve_chen` picks the cheapest that fits, and the
    Kusumoto DPs check their own plans against it (:mod:`.kusumoto`).

    Kept per graph object and content (:func:`.content_keys.signature`, so an edited graph is tried
    again), each call handed fresh plans: they depend on no budget, and ``combined``'s least-budget
    search asked for them 230 times on the CPU-size GoogLeNet (a third of its time, measured)."""
    key = (thresholds, signature(graph))
    with _lock:
        got = _kept.get(graph)
    if got is None or got[0] != key:
        got = (key, [(peak, t, plan.to_dict()) for peak, t, plan in _tried(graph, thresholds)])
        with _lock:
            _kept[graph] = got
    return [(peak, t, Plan.from_dict(d)) for peak, t, d in got[1]]


_kept: weakref.WeakKeyDictionary[Graph, tuple[tuple[int, int], list[tuple[int, float, dict]]]] = \
    weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _tried(graph: Graph, thresholds: int) -> list[tuple[int, float, Plan]]:
    if graph.meta.get("mode") == "module":
        return _module_plans(graph)
    tried: list[tuple[int, float, Plan]] = []

    def consider(plan: Plan) -> None:
        sim = simulate(graph, plan, check=False, record=False)
        tried.append((sim.peak_bytes, sim.extra_time_s, plan))

    consider(no_recompute_plan(graph))
    cands = set(split_candidates(graph))
    if cands and len(graph) > 1:
        total = graph.total("saved_bytes")
        sizes = sorted(b for b in (graph.node(v)["saved_bytes"] for v in graph.nodes) if b > 0)
        lo = max(1.0, float(sizes[0]) if sizes else 1.0)
        hi = max(lo, float(total))
        levels = {0.0, total / max(1.0, math.sqrt(len(graph)))}
        for i in range(thresholds):
            levels.add(lo * (hi / lo) ** (i / max(1, thresholds - 1)))
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for b in sorted(levels):
            segs = segments_from_lower_sets(graph, segment_by_threshold(graph, b, cands))
            key = tuple(s.nodes for s in segs)
            if key in seen:
                continue
            seen.add(key)
            consider(Plan(segs, solver="chen", options={"threshold_bytes": b}))
    return tried


def _pick(tried: list[tuple[int, float, Plan]], budget_bytes: int, solver: str) -> Plan:
    fits = [t for t in tried if t[0] <= budget_bytes]
    if not fits:
        raise InfeasibleBudgetError(budget_bytes, min(t[0] for t in tried), solver=solver)
    fits.sort(key=lambda t: (t[1], t[0]))
    return fits[0][2]


def _module_plans(graph: Graph) -> list[tuple[int, float, Plan]]:
    def saved(unit: tuple[int, ...]) -> float:
        return sum(graph.node(v)["saved_bytes"] for v in unit)

    def time(unit: tuple[int, ...]) -> float:
        return max(sum(graph.node(v)["time_s"] for v in unit), 1e-9)

    order = [u for u in graph.recompute_units() if saved(u) > 0]
    order.sort(key=lambda u: -saved(u) / time(u))

    def plan_for(k: int) -> Plan:
        chosen = {u[0]: u for u in order[:k]}
        segs: list[Segment] = []
        run: list[int] = []
        skip: set[int] = set()
        for v in graph.nodes:
            if v in skip:
                continue
            if v in chosen:
                if run:
                    segs.append(Segment(tuple(run), recompute=False))
                    run = []
                segs.append(Segment(chosen[v], recompute=True))
                skip.update(chosen[v])
            else:
                run.append(v)
        if run:
            segs.append(Segment(tuple(run), recompute=False))
        return Plan(segs, solver="chen", options={"checkpointed_modules": k})

    tried: list[tuple[int, float, Plan]] = []

    def evaluate(k: int) -> tuple[int, float, Plan]:
        p = plan_for(k)
        sim = simulate(graph, p, check=False, record=False)
        tried.append((sim.peak_bytes, sim.extra_time_s, p))
        return tried[-1]

    # Every prefix length: the peak is not monotone in it (checkpointing the last module
    # only delays its recomputation), and module graphs are small.
    for k in range(len(order) + 1):
        evaluate(k)
    return tried
