"""A lower bound on the step time of any offload plan that fits a budget (issue 22's yardstick).

Problem: on a graph with nothing recomputed, how fast can *any* choice of offloaded storages,
copy order, forward waits and prefetch schedule be, under the simulator's transfer model
(:mod:`autoremat.cost.offload_link`: one transfer at a time per direction at ``B`` bytes per
second, device memory freed once a copy to host is complete and forward no longer reads the
storage, reserved when its prefetch starts)? The answer tells a target that cannot be met by any
plan from one that the solver misses.

Method: Beaumont et al.'s fractional relaxation (§4 of [1]: a storage may move in parts), applied
at every node of the unpatched step whose level (:func:`autoremat.cost.step_levels`) exceeds the
budget ``M``, forward or backward, on the graph itself. At such a node ``v`` (level ``L``, running
from ``t`` to ``t'``) at least ``Q = L - M`` bytes of storages kept for backward
(:func:`~autoremat.plan.offloadable_nodes`, and the saved-tensor units of module calls,
:func:`~autoremat.plan.saved_unit_nodes`) that nothing reads then must be on the host: in
forward, those forward no longer reads before ``v``; in backward, those first needed after ``v``.

* *Copies out*: bytes produced at time ``s`` or later can only leave in ``[s, t]``, so
  ``A(<s) + B (t + w - s) >= Q`` for every ``s`` (``A(<s)``: those bytes produced before ``s``),
  ``w`` the step's waiting before ``t``.
* *Copies back*: those needed by time ``u`` must come back in ``[t', u]``, so
  ``E(>u) + B (u - t' + w') >= Q`` for every ``u`` (``E(>u)``: those needed after ``u``), ``w'`` the
  waiting after ``t'``.

A waiting needed before ``t`` and one needed after ``t' >= t`` are disjoint stretches of the step,
so the bound is the compute time plus the largest such pair (:func:`_disjoint_waits`), or
infinite when some node cannot shed ``Q`` at all. Every plan the simulator can judge satisfies
these constraints, so its predicted step time is never below the bound (tested against
:func:`.offload_bruteforce.solve_offload_bruteforce` on seeded random graphs). Loss levels are
left out (fewer constraints: still a lower bound). It ignores that a storage moves whole, the
one-ahead prefetch and the order of copies: it is not tight.

.. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies for Deep
   Neural Network Training", hal-02316266, 2019.

Complexity: O(n · c log c) for ``n`` nodes and ``c`` candidates, after one simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost import DEFAULT_BANDWIDTH_BYTES_PER_S, no_recompute_plan, step_levels
from ...graph import Graph
from ...plan import offloadable_nodes, saved_unit_nodes
from ...region_units import region_unit

__all__ = ["OffloadBound", "offload_time_lower_bound"]


@dataclass(frozen=True)
class OffloadBound:
    """The lower bound of :func:`offload_time_lower_bound` (seconds; ``inf`` where infeasible)."""

    compute_s: float
    out_wait_s: float
    """Waiting the copies to host force before some node (forward or backward)."""
    in_wait_s: float
    """Waiting the copies back force after a later node (disjoint from ``out_wait_s``)."""
    bandwidth_bytes_per_s: float
    budget_bytes: int
    most_bytes_to_shed: int
    """The largest ``L - M`` over the nodes above the budget (what must be on the host then)."""

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.out_wait_s + self.in_wait_s

    @property
    def time_ratio(self) -> float:
        """The bound over the unpatched step time (compute alone)."""
        return self.step_time_s / self.compute_s if self.compute_s else math.inf


def _needed_wait(shed: int, points: list[tuple[float, int]], t: float, rate: float, forward: bool) -> float:
    """The least wait ``w`` with ``before(s) + rate (t + w - s) >= shed`` for every arrival ``s``
    (forward; ``points`` are (time produced, bytes), sorted) or ``after(u) + rate (u + w - t) >= shed``
    for every need time ``u`` (backward; (time needed, bytes), sorted)."""
    if sum(b for _, b in points) < shed:
        return math.inf
    w = 0.0
    if forward:
        before = 0
        w = max(w, shed / rate - t)  # s = 0: nothing produced before the step starts
        for s, nbytes in points:
            w = max(w, (shed - before) / rate - (t - s))
            before += nbytes
    else:
        after = sum(b for _, b in points)
        for u, nbytes in points:
            after -= nbytes
            w = max(w, (shed - after) / rate - (u - t))
    return max(0.0, w)


def offload_time_lower_bound(graph: Graph, budget_bytes: int, *,
                             bandwidth_bytes_per_s: float | None = None) -> OffloadBound:
    """The least predicted step time any offload plan (nothing recomputed) fitting ``budget_bytes``
    can have under the simulator's transfer model (module docstring)."""
    rate = float(bandwidth_bytes_per_s or graph.meta.get("bandwidth_bytes_per_s") or DEFAULT_BANDWIDTH_BYTES_PER_S)
    plan = no_recompute_plan(graph)
    lv = step_levels(graph, plan)
    order = [v for seg in plan.segments for v in seg.nodes]
    pos = {v: i for i, v in enumerate(order)}
    start, clock = {}, 0.0
    for v in order:
        start[("f", v)] = clock
        clock += graph.node(v)["time_s"]
    for v in reversed(order):
        start[("b", v)] = clock
        clock += graph.node(v)["bwd_time_s"]
    compute = clock
    size, produced, last_read, first_need = _lifetimes(graph, plan, order, pos, start)
    pre: list[tuple[float, float]] = []  # (time, least waiting before it)
    post: list[tuple[float, float]] = []  # (time, least waiting after it)
    shed_most = 0
    for phase, v in [("f", v) for v in order] + [("b", v) for v in reversed(order)]:
        level = (lv.fwd_touch if phase == "f" else lv.bwd_touch)[v]
        if level is None or level <= budget_bytes:
            continue
        shed = level - budget_bytes
        shed_most = max(shed_most, shed)
        on_host = [r for r in size if (last_read[r] < pos[v] if phase == "f" else first_need[r] < pos[v])]
        begin = start[(phase, v)]
        end = begin + graph.node(v)["time_s" if phase == "f" else "bwd_time_s"]
        out = sorted((produced[r], size[r]) for r in on_host)
        back = sorted((start[("b", order[first_need[r]])], size[r]) for r in on_host)
        pre.append((begin, _needed_wait(shed, out, begin, rate, True)))
        post.append((end, _needed_wait(shed, back, end, rate, False)))
    out_s, in_s = _disjoint_waits(pre, post)
    return OffloadBound(compute, out_s, in_s, rate, int(budget_bytes), int(shed_most))


def _lifetimes(graph: Graph, plan, order: list[int], pos: dict[int, int], start: dict) -> tuple[dict, ...]:
    """Per offload candidate: bytes, when produced, its last forward reader's position, and its
    first backward use's position (the saver that runs last in forward)."""
    ends = graph.held_roots(to_end=True)  # the output object holds their device copy to the end
    cands = set(offloadable_nodes(graph, plan)) - ends
    size: dict[int, int] = {}
    produced: dict[int, float] = {}
    last_read: dict[int, int] = {}
    first_need: dict[int, int] = {}
    for v in order:
        r = graph.root(v)
        if r not in cands:
            continue
        size[r] = int(graph.node(r)["alloc_bytes"])
        produced.setdefault(r, start[("f", r)] + graph.node(r)["time_s"])
        last = len(order) if graph.held_to_loss(v) else pos[r]
        last_read[r] = max(last_read.get(r, pos[r]), last, *(pos[w] for w in graph.succ(v)))
    for w in order:
        d = graph.node(w)
        if d["requires_grad"]:
            for u in d["saves"]:
                if graph.root(u) in size:
                    first_need[graph.root(u)] = max(first_need.get(graph.root(u), -1), pos[w])
    for key, nbytes, last, need in _units(graph, plan, pos, cands):
        size[key], last_read[key], first_need[key] = nbytes, last, need
        produced[key] = start[("f", order[last])] + graph.node(order[last])["time_s"]
    keep = [r for r in size if r in first_need and size[r] > 0]
    return ({r: size[r] for r in keep}, produced, last_read, first_need)


def _units(graph: Graph, plan, pos: dict[int, int], cands: set[int]) -> list[tuple[int, int, int, int]]:
    """The saved-tensor units a plan may offload (:func:`~autoremat.plan.saved_unit_nodes`) as
    candidates ``(-1 - v, bytes, position of the last forward node, position of the first
    backward need)``: a module call's own saved tensors, ready when its forward ends and needed
    when its backward starts; a block captured op by op, ready when its last op ends and needed
    from the backward of its last op that holds a part, less the storages already candidates."""
    out = []
    for v in sorted(saved_unit_nodes(graph, plan)):
        ru = region_unit(graph, v) if graph.node(v)["op_index"] >= 0 else None
        if ru is None:
            out.append((-1 - v, int(graph.node(v)["extra_saved_bytes"]), pos[v], pos[v]))
        else:
            nbytes = ru.nbytes - sum(int(graph.node(r)["alloc_bytes"]) for r in ru.roots if r in cands)
            out.append((-1 - v, nbytes, pos[ru.last], pos[ru.first_use]))
    return out


def _disjoint_waits(pre: list[tuple[float, float]], post: list[tuple[float, float]]) -> tuple[float, float]:
    """The largest ``a + b`` over a waiting ``a`` needed before time ``t`` and ``b`` needed after
    time ``t' >= t`` (disjoint stretches of the step: both are waited); returned as ``(a, b)``."""
    best = (max((w for _, w in pre), default=0.0), 0.0)
    best_pre = 0.0
    events = sorted([(t, 0, w) for t, w in pre] + [(t, 1, w) for t, w in post])
    for _t, kind, w in events:
        if kind == 0:
            best_pre = max(best_pre, w)
        elif best_pre + w > sum(best):
            best = (best_pre, w)
    return best
