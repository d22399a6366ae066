"""The mixed-integer program of ``"milp"``: canonical strategies of at most ``k`` segments.

Variables (``i`` = segment index ``0..k-1``, execution order):

* ``e[v,i]`` (``i = 1..k-1``) = [node ``v`` lies in segment ``i`` or later]; non-increasing in
  ``i``; ``x[v,i] = e[v,i] - e[v,i+1]`` (``e[v,0] = 1``, ``e[v,k] = 0``) is "``v`` in segment ``i``".
  A lower-set sequence is ``e[u,i] <= e[v,i]`` for every edge ``u -> v`` (and every saved or
  aliased node ``u`` of ``v``; at module level ``u = v - 1`` too: :attr:`~autoremat.graph.Graph.in_program_order`).
* ``r[i]`` = segment ``i`` is recomputed, ``ne[i]`` = segment ``i`` is non-empty. Empty segments
  come last and are not recomputed, so every plan has exactly one encoding (the no-good cuts
  of :mod:`.search` then remove exactly one plan each).
* ``y[v,i] = x[v,i] AND r[i]`` (exact: three rows); non-recomputable nodes get none (``r[i]``
  then forbids them in segment ``i``); module-level graphs recompute one node per segment.

Extra time (exact for every plan, no tails): the simulator replays a recomputed segment up to
its last *holder* (a node that saves a tensor or extras and requires grad), so node ``v`` costs
``time_s(v)`` when ``y[v,i] = 1`` and segment ``i`` holds a holder at ``v`` or later
(``hs[v,i]``, chained down the node ids). The objective is ``sum time_s(v) * z[v]``.

Memory (a *relaxation*: for every plan and the aux values the solver can pick, each row's
left side is at most what :func:`autoremat.cost.simulate` has live at one of its peak
checks, so every plan that fits the budget in simulation is feasible here):

* at the loss forward: every storage held for backward (saved by a node outside recomputed
  segments, an input of a recomputed segment, a model output), the extras of non-recomputed
  savers, and the loss's own extra, storage (``loss_held_bytes``) and workspace; at the loss
  backward the same without the outputs, with the outputs' gradients and the loss's saved
  storages; the loss's storage stays in every replay and backward row below;
* at the replay of each recomputed segment ``i`` that has a holder (its last holder's replay
  forward): the storages held for backward by the segments before ``i`` (saved by their
  non-recomputed nodes, or inputs of recomputed segments up to ``i``), the extras of those
  savers, the recomputed copies of the storages the segment's savers save from themselves or
  their direct inputs, the parameter gradients of the nodes after segment ``i``, and the own
  gradient buffers of the nodes before segment ``i`` whose successors after it have run backward
  (only nodes whose consumers never pass their gradient through, so the buffer is their own);
* at the backward of each node with an output gradient (all of them up to 40 nodes, else the 8
  highest in the plan without recomputation; :mod:`.rows`): its own need (below) plus the
  storages still saved by savers whose backward is still to run, the inputs of recomputed
  segments up to its own, the extras of plain savers still to run, the copies saved by the
  earlier savers of its recomputed segment (when it holds something), the own gradient buffers
  of nodes still to run whose gradient-reading successors (or the loss) have run, and the
  parameter gradients of the nodes that have run; "runs before" in backward is linearised per
  pair of nodes and segment (on large graphs only the 48 heaviest storages, buffers and extras);
* plan-independent checks (:func:`constant_floor`): each node's forward (its output, extras,
  workspace and its inputs' storages) and backward (its saved storages, extras, workspace, its
  parameters' gradients, and its inputs' gradients where it does not pass them through), and the
  loss.

What it leaves out (so a plan the program admits may still simulate above the budget; the
search checks every plan with the simulator): gradient buffers shared through pass-through ops,
transients (a sum out of place into a first gradient that is a view among them), forward values
in flight, workspaces along the plan, the replay's extras, and the execution order of the forward
(segments run in sequence, so a plan may run nodes out of id order; the relaxation does not depend
on that order). Offload is not modelled: ``milp`` plans never offload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...graph import Graph
from ...plan import Plan, Segment
from .facts import Expr, constant_floor, has_grad, holder, lin, merge, sub
from .highs import Builder
from .rows import backward_rows, memory_rows, pick_checks

__all__ = ["Formulation", "constant_floor", "has_grad"]


@dataclass
class Formulation:
    """The program for one graph and ``k``; memory rows are ``lhs - M * (1 - act) <= budget`` (or
    ``<= P`` in the memory-centric form, ``objective="memory"``)."""

    graph: Graph
    k: int
    objective: str = "time"
    b: Builder = field(default_factory=Builder)
    e: dict[tuple[int, int], int] = field(default_factory=dict)
    r: list[int] = field(default_factory=list)
    y: dict[tuple[int, int], int] = field(default_factory=dict)
    mem_rows: list[tuple[int, float]] = field(default_factory=list)  # (row, constant on its left side)
    peak_var: int | None = None
    max_checks: int | None = None
    """Backward rows: every node with a gradient up to 40 nodes, else the 8 highest (see :meth:`_pick_checks`)."""
    max_terms: int | None = None
    """Per backward row, the heaviest storages, gradients and extras kept (all up to 40 nodes, else 48)."""
    checks: list[int] = field(default_factory=list)
    """Nodes whose backward gets a memory row (see :meth:`_backward_rows`)."""
    cin: dict[tuple[int, int], int] = field(default_factory=dict)
    _order: dict[tuple[int, int, bool], tuple[int | None, float]] = field(default_factory=dict)
    time_scale: float = 1.0
    mem_scale: float = 1.0

    # -------------------------------------------------------------- expressions
    def E(self, v: int, i: int) -> tuple[Expr, float]:
        if i <= 0:
            return {}, 1.0
        if i >= self.k:
            return {}, 0.0
        return {self.e[v, i]: 1.0}, 0.0

    def X(self, v: int, i: int) -> tuple[Expr, float]:
        return sub(self.E(v, i), self.E(v, i + 1))

    def before(self, v: int, i: int) -> tuple[Expr, float]:
        """``v`` in a segment before ``i``."""
        t, c = self.E(v, i)
        return {col: -a for col, a in t.items()}, 1.0 - c

    def after(self, v: int, i: int) -> tuple[Expr, float]:
        return self.E(v, i + 1)

    def rec(self, v: int) -> tuple[Expr, float]:
        return {self.y[v, i]: 1.0 for i in range(self.k) if (v, i) in self.y}, 0.0

    def ge(self, var: int, *parts: tuple[tuple[Expr, float], float]) -> None:
        """``var >= sum(sign * part)``."""
        terms: Expr = {var: 1.0}
        const = 0.0
        for (t, c), sign in parts:
            for col, a in t.items():
                terms[col] = terms.get(col, 0.0) - sign * a
            const += sign * c
        self.b.row(terms, const, float("inf"))

    # -------------------------------------------------------------- building
    def build(self, reference_bytes: int) -> "Formulation":
        """Build the program; memory is scaled so that ``reference_bytes`` is 1e6 units."""
        g, k, b = self.graph, self.k, self.b
        n = len(g)
        total_t = float(g.total("time_s")) or 1.0
        self.time_scale = 1000.0 / total_t
        self.mem_scale = 1e6 / max(1, int(reference_bytes))
        for v in g.nodes:
            for i in range(1, k):
                self.e[v, i] = b.var()
            for i in range(1, k - 1):
                b.row({self.e[v, i]: 1.0, self.e[v, i + 1]: -1.0}, 0.0, float("inf"))
        deps = {(u, v) for u, v in g.nx.edges} | ({(v - 1, v) for v in g.nodes if v} if g.in_program_order else set())
        for v in g.nodes:
            d = g.node(v)
            deps.update((u, v) for u in d["saves"] if u != v)
            if d["alias_of"] is not None:
                deps.add((d["alias_of"], v))
        for u, v in deps:
            for i in range(1, k):
                b.row({self.e[v, i]: 1.0, self.e[u, i]: -1.0}, 0.0, float("inf"))
        self.r = [b.var() for _ in range(k)]
        ne = [b.var() for _ in range(k)]
        module = g.meta.get("mode") == "module"
        for i in range(k):
            size = lin([self.X(v, i) for v in g.nodes])
            self.b.row(merge({ne[i]: 1.0}, size[0], -1.0), float("-inf"), size[1])  # ne <= |seg|
            if i + 1 < k:
                nxt = lin([self.X(v, i + 1) for v in g.nodes])
                self.b.row(merge({ne[i]: -float(n)}, nxt[0], 1.0), float("-inf"), -nxt[1])  # |seg i+1| <= n ne_i
            b.row({self.r[i]: 1.0, ne[i]: -1.0}, float("-inf"), 0.0)
            if module:
                self.b.row(merge({self.r[i]: float(n)}, size[0], 1.0), float("-inf"), 1.0 + n - size[1])
        for v in g.nodes:
            if not g.node(v)["recomputable"]:
                for i in range(k):
                    t, c = self.X(v, i)
                    b.row(merge({self.r[i]: 1.0}, t, 1.0), float("-inf"), 1.0 - c)
                continue
            for i in range(k):
                y = self.y[v, i] = b.var()
                t, c = self.X(v, i)
                b.row(merge({y: 1.0}, t, -1.0), float("-inf"), c)          # y <= x
                b.row({y: 1.0, self.r[i]: -1.0}, float("-inf"), 0.0)        # y <= r
                b.row(merge({y: 1.0, self.r[i]: -1.0}, t, -1.0), c - 1.0, float("inf"))  # y >= x + r - 1
        hold = self._time_terms()
        if self.objective == "memory":
            self.peak_var = b.var(cost=1.0, lb=0.0, ub=float("inf"), integer=False)
        storages = memory_rows(self, hold)
        self.checks = pick_checks(self)
        backward_rows(self, deps, storages)
        return self

    def _time_terms(self) -> list[int]:
        """Objective terms; returns ``hs[0,i]`` (segment ``i`` has a holder) per segment."""
        g, k, b = self.graph, self.k, self.b
        n = len(g)
        holders = [v for v in g.nodes if holder(g.node(v))]
        hset = set(holders)
        hs: dict[tuple[int, int], int] = {}
        for i in range(k):
            for v in reversed(range(n)):
                hs[v, i] = b.var(integer=False)  # integral at every vertex: bounded by binaries both ways
                if v + 1 < n:
                    b.row({hs[v, i]: 1.0, hs[v + 1, i]: -1.0}, 0.0, float("inf"))
            for v in holders:
                self.ge(hs[v, i], (self.X(v, i), 1.0))
            nh = lin([self.X(h, i) for h in holders])  # hs[0,i] <= number of holders in segment i
            b.row(merge({hs[0, i]: 1.0}, nh[0], -1.0), float("-inf"), nh[1])
        cost = 1.0 if self.objective == "time" else 0.0
        for v in g.nodes:
            t = float(g.node(v)["time_s"])
            if t <= 0 or not any((v, i) in self.y for i in range(k)):
                continue
            z = b.var(cost=cost * t * self.time_scale, integer=False)
            if v in hset:  # a holder is always replayed when recomputed: z = rec(v), tight in the LP
                self.ge(z, (self.rec(v), 1.0))
                continue
            for i in range(k):
                if (v, i) in self.y:
                    b.row({z: 1.0, self.y[v, i]: -1.0, hs[v, i]: -1.0}, -1.0, float("inf"))
        return [hs[0, i] for i in range(k)]

    def mem_row(self, terms: Expr, const: float, act: int | None) -> None:
        """``terms + const <= budget`` when ``act`` (always when ``None``); the right side is set
        by :meth:`set_budget` (time-centric) or is the peak variable (memory-centric)."""
        s = self.mem_scale
        row = {c: a * s for c, a in terms.items()}
        big = 0.0
        if act is not None:
            big = (sum(a for a in row.values() if a > 0) + const * s) * 1.01 + 1.0
            row[act] = row.get(act, 0.0) + big
        cst = const * s - big
        if self.peak_var is not None:
            row[self.peak_var] = -1.0
            self.b.row(row, float("-inf"), -cst)
        else:
            self.mem_rows.append((self.b.row(row, float("-inf"), 0.0), cst))

    # -------------------------------------------------------------- solutions and cuts
    def set_budget(self, h: object, budget: float) -> None:
        for row, cst in self.mem_rows:
            h.changeRowBounds(row, float("-inf"), budget * self.mem_scale - cst)  # type: ignore[attr-defined]

    def binaries(self) -> list[int]:
        return [*self.e.values(), *self.r]

    def decode(self, values: Sequence[float]) -> Plan:
        g, k = self.graph, self.k
        segs: list[list[int]] = [[] for _ in range(k)]
        for v in g.nodes:
            i = sum(1 for j in range(1, k) if values[self.e[v, j]] > 0.5)
            segs[i].append(v)
        out = [Segment(tuple(s), recompute=bool(values[self.r[i]] > 0.5)) for i, s in enumerate(segs) if s]
        return Plan(out, solver="milp")

    def encode(self, plan: Plan) -> dict[int, float] | None:
        """The binaries of ``plan`` (``None`` when it has more than ``k`` segments)."""
        if len(plan.segments) > self.k:
            return None
        vals: dict[int, float] = {c: 0.0 for c in self.binaries()}
        for i, seg in enumerate(plan.segments):
            vals[self.r[i]] = 1.0 if seg.recompute else 0.0
            for v in seg.nodes:
                for j in range(1, i + 1):
                    vals[self.e[v, j]] = 1.0
        return vals
