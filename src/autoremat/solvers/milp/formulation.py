"""The mixed-integer program of ``"milp"``: canonical strategies of at most ``k`` segments.

Variables (``i`` = segment index ``0..k-1``, execution order):

* ``e[v,i]`` (``i = 1..k-1``) = [node ``v`` lies in segment ``i`` or later]; non-increasing in
  ``i``; ``x[v,i] = e[v,i] - e[v,i+1]`` (``e[v,0] = 1``, ``e[v,k] = 0``) is "``v`` in segment ``i``".
  A lower-set sequence is ``e[u,i] <= e[v,i]`` for every edge ``u -> v`` (and every saved or
  aliased node ``u`` of ``v``).
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
left side is at most what :func:`autoremat.simulate.simulate` has live at one of its peak
checks, so every plan that fits the budget in simulation is feasible here):

* at the loss forward: every storage held for backward (saved by a node outside recomputed
  segments, an input of a recomputed segment, a model output), the extras of non-recomputed
  savers, and the loss's own extra and workspace; at the loss backward the same without the
  outputs, with the outputs' gradients and the loss's saved storages;
* at the replay of each recomputed segment ``i`` that has a holder (its last holder's replay
  forward): the storages held for backward by the segments before ``i`` (saved by their
  non-recomputed nodes, or inputs of recomputed segments up to ``i``), the extras of those
  savers, the recomputed copies of the storages the segment's savers save from themselves or
  their direct inputs, the parameter gradients of the nodes after segment ``i``, and the own
  gradient buffers of the nodes before segment ``i`` whose successors after it have run backward
  (only nodes whose consumers never pass their gradient through, so the buffer is their own);
* plan-independent checks (:func:`constant_floor`): each node's forward (its output, extras,
  workspace and its inputs' storages) and backward (its saved storages, extras, workspace, its
  parameters' gradients, and its inputs' gradients where it does not pass them through), and the
  loss.

What it leaves out (so a plan the program admits may still simulate above the budget; the
search checks every plan with the simulator): gradient buffers shared through pass-through ops,
transients, forward values in flight, workspaces along the plan, the replay's extras, and the
execution order of the forward (segments run in sequence, so a plan may run nodes out of id
order; the relaxation does not depend on that order). Offload is not modelled: ``milp`` plans
never offload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...graph import Graph
from ...plan import Plan, Segment
from ...simulate import no_recompute_plan, simulate
from .highs import Builder

__all__ = ["Formulation", "constant_floor", "has_grad"]

Expr = dict[int, float]


def has_grad(graph: Graph) -> list[bool]:
    """Whether each node receives an output gradient in backward (plan-independent)."""
    n = len(graph)
    out = [False] * n
    for v in reversed(range(n)):
        d = graph.node(v)
        if not d["requires_grad"]:
            continue
        out[v] = bool(d["is_output"]) or any(out[w] for w in graph.succ(v))
    return out


def _holder(d: dict) -> bool:
    return bool(d["requires_grad"] and (d["saves"] or d["extra_saved_bytes"]))


def _backward_need(g: Graph, v: int, pb: dict) -> int:
    """What node ``v``'s backward has live whatever the plan: its saved storages and extras, its
    workspace, its parameters' gradients and (unless it passes its gradient through) its inputs'."""
    d = g.node(v)
    saved = sum(g.node(r)["alloc_bytes"] for r in {g.root(u) for u in d["saves"]}) if d["requires_grad"] else 0
    extra = d["extra_saved_bytes"] if d["requires_grad"] else 0
    grads = 0 if d["grad_passthrough"] else sum(g.node(u)["out_bytes"] for u in g.pred(v) if g.node(u)["requires_grad"])
    params = sum(pb[p] for p in set(d["params"]) if p in pb)
    return int(saved + extra + grads + params + d["bwd_temp_bytes"])


def constant_floor(graph: Graph) -> int:
    """A plan-independent lower bound of the simulated step peak (see the module docstring)."""
    g = graph
    pb = g.meta.get("param_bytes", {})
    grad = has_grad(g)
    best = 0
    for v in g.nodes:
        d = g.node(v)
        roots = {g.root(u) for u in g.pred(v)}
        if d["alias_of"] is None:
            roots.add(v)
        fwd = sum(g.node(r)["alloc_bytes"] for r in roots) + d["extra_saved_bytes"] + d["fwd_temp_bytes"]
        best = max(best, fwd)
        if grad[v]:
            best = max(best, _backward_need(g, v, pb))
    meta = g.meta
    outs = {g.root(v) for v in g.nodes if g.node(v)["is_output"]}
    best = max(best, sum(g.node(r)["alloc_bytes"] for r in outs) + meta["loss_extra_bytes"] + meta["loss_fwd_temp_bytes"])
    ograds = sum(g.node(v)["out_bytes"] for v in g.nodes if g.node(v)["is_output"] and g.node(v)["requires_grad"])
    lsaves = sum(g.node(r)["alloc_bytes"] for r in {g.root(u) for u in meta["loss_saves"]})
    return int(max(best, ograds + lsaves + meta["loss_bwd_temp_bytes"]))


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
        return _sub(self.E(v, i), self.E(v, i + 1))

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
        deps = {(u, v) for u, v in g.nx.edges}
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
            size = _lin([self.X(v, i) for v in g.nodes])
            self.b.row(_merge({ne[i]: 1.0}, size[0], -1.0), float("-inf"), size[1])  # ne <= |seg|
            if i + 1 < k:
                nxt = _lin([self.X(v, i + 1) for v in g.nodes])
                self.b.row(_merge({ne[i]: -float(n)}, nxt[0], 1.0), float("-inf"), -nxt[1])  # |seg i+1| <= n ne_i
            b.row({self.r[i]: 1.0, ne[i]: -1.0}, float("-inf"), 0.0)
            if module:
                self.b.row(_merge({self.r[i]: float(n)}, size[0], 1.0), float("-inf"), 1.0 + n - size[1])
        for v in g.nodes:
            if not g.node(v)["recomputable"]:
                for i in range(k):
                    t, c = self.X(v, i)
                    b.row(_merge({self.r[i]: 1.0}, t, 1.0), float("-inf"), 1.0 - c)
                continue
            for i in range(k):
                y = self.y[v, i] = b.var()
                t, c = self.X(v, i)
                b.row(_merge({y: 1.0}, t, -1.0), float("-inf"), c)          # y <= x
                b.row({y: 1.0, self.r[i]: -1.0}, float("-inf"), 0.0)        # y <= r
                b.row(_merge({y: 1.0, self.r[i]: -1.0}, t, -1.0), c - 1.0, float("inf"))  # y >= x + r - 1
        hold = self._time_terms()
        if self.objective == "memory":
            self.peak_var = b.var(cost=1.0, lb=0.0, ub=float("inf"), integer=False)
        self._memory_rows(hold)
        self.checks = self._pick_checks()
        self._backward_rows(deps)
        return self

    def _time_terms(self) -> list[int]:
        """Objective terms; returns ``hs[0,i]`` (segment ``i`` has a holder) per segment."""
        g, k, b = self.graph, self.k, self.b
        n = len(g)
        holders = [v for v in g.nodes if _holder(g.node(v))]
        hset = set(holders)
        hs: dict[tuple[int, int], int] = {}
        for i in range(k):
            for v in reversed(range(n)):
                hs[v, i] = b.var(integer=False)  # integral at every vertex: bounded by binaries both ways
                if v + 1 < n:
                    b.row({hs[v, i]: 1.0, hs[v + 1, i]: -1.0}, 0.0, float("inf"))
            for v in holders:
                self.ge(hs[v, i], (self.X(v, i), 1.0))
            lin = _lin([self.X(h, i) for h in holders])  # hs[0,i] <= number of holders in segment i
            b.row(_merge({hs[0, i]: 1.0}, lin[0], -1.0), float("-inf"), lin[1])
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

    def _memory_rows(self, hold: list[int]) -> None:
        g, k, b = self.graph, self.k, self.b
        pb = g.meta.get("param_bytes", {})
        grad = has_grad(g)
        alloc = [int(g.node(v)["alloc_bytes"]) for v in g.nodes]
        savers: dict[int, list[int]] = {}  # root -> savers
        for w in g.nodes:
            dw = g.node(w)
            if dw["requires_grad"]:
                for r in {g.root(u) for u in dw["saves"]}:
                    if alloc[r] > 0:
                        savers.setdefault(r, []).append(w)
        inputs: dict[int, list[tuple[int, int]]] = {}  # root -> edges (u, w) whose input u has it
        for u, w in g.nx.edges:
            r = g.root(u)
            if alloc[r] > 0 and g.node(w)["recomputable"]:
                inputs.setdefault(r, []).append((u, w))
        cin = self.cin = {}
        for r, edges in inputs.items():
            for i in range(k):
                c = cin[r, i] = b.var(integer=False)
                if i:
                    b.row({c: 1.0, cin[r, i - 1]: -1.0}, 0.0, float("inf"))
                for u, w in edges:
                    self.ge(c, (({self.y[w, i]: 1.0}, 0.0), 1.0), (self.X(u, i), -1.0))
        outs = {g.root(v) for v in g.nodes if g.node(v)["is_output"]}
        extras = [w for w in g.nodes if g.node(w)["requires_grad"] and g.node(w)["extra_saved_bytes"]]
        # ---- the loss: forward (outputs alive) and backward (outputs' gradients, loss saves)
        lsaves = {g.root(u) for u in g.meta["loss_saves"]}
        fwd: Expr = {}
        bwd: Expr = {}
        fconst = float(g.meta["loss_extra_bytes"] + g.meta["loss_fwd_temp_bytes"])
        bconst = float(g.meta["loss_extra_bytes"] + g.meta["loss_bwd_temp_bytes"])
        bconst += sum(g.node(v)["out_bytes"] for v in g.nodes if g.node(v)["is_output"] and g.node(v)["requires_grad"])
        for r in set(savers) | set(inputs) | outs | lsaves:
            if alloc[r] == 0:
                continue
            if r in outs:
                fconst += alloc[r]
            if r in lsaves:
                bconst += alloc[r]
            if (r in outs and r in lsaves) or (r not in savers and r not in inputs):
                continue
            live = b.var(integer=False)
            for w in savers.get(r, ()):
                self.ge(live, (({}, 1.0), 1.0), (self.rec(w), -1.0))
            if r in cin:
                self.ge(live, (({cin[r, k - 1]: 1.0}, 0.0), 1.0))
            if r not in outs:
                fwd[live] = float(alloc[r])
            if r not in lsaves:
                bwd[live] = float(alloc[r])
        for w in extras:
            xb = float(g.node(w)["extra_saved_bytes"])
            fconst += xb
            bconst += xb
            for col, a in self.rec(w)[0].items():
                fwd[col] = fwd.get(col, 0.0) - a * xb
                bwd[col] = bwd.get(col, 0.0) - a * xb
        self._mem_row(fwd, fconst, None)
        self._mem_row(bwd, bconst, None)
        # ---- the replay of each recomputed segment
        copies = [(u, w) for w in g.nodes if _holder(g.node(w)) for u in g.node(w)["saves"]
                  if alloc[u] > 0 and g.node(u)["alias_of"] is None and (u == w or u in g.pred(w))
                  and (w, 0) in self.y]
        own = [u for u in g.nodes if g.node(u)["requires_grad"]
               and all(not g.node(w)["grad_passthrough"] for w in g.succ(u) if grad[w])]
        puse = [(p, v) for v in g.nodes if grad[v] for p in set(g.node(v)["params"]) if p in pb]
        for i in range(k):
            terms = {}
            for r in set(savers) | set(inputs):
                held = b.var(integer=False)
                for w in savers.get(r, ()):
                    self.ge(held, (self.before(w, i), 1.0), (self.rec(w), -1.0))
                if r in cin:
                    self.ge(held, (({cin[r, i]: 1.0}, 0.0), 1.0))
                terms[held] = float(alloc[r])
            for w in extras:
                xb = b.var(integer=False)
                self.ge(xb, (self.before(w, i), 1.0), (self.rec(w), -1.0))
                terms[xb] = float(g.node(w)["extra_saved_bytes"])
            cp: dict[int, int] = {}
            for u, w in copies:
                if u not in cp:
                    cp[u] = b.var(integer=False)
                    terms[cp[u]] = float(alloc[u])
                self.ge(cp[u], (({self.y[w, i]: 1.0}, 0.0), 1.0), (self.X(u, i), 1.0), (({}, 1.0), -1.0))
            pg: dict[str, int] = {}
            for p, v in puse:
                if p not in pg:
                    pg[p] = b.var(integer=False)
                    terms[pg[p]] = float(pb[p])
                self.ge(pg[p], (self.after(v, i), 1.0))
            for u in own:
                later = [w for w in g.succ(u) if grad[w]]
                out = g.node(u)["is_output"]
                if not (later or out) or g.node(u)["out_bytes"] <= 0 or i == 0:
                    continue
                gl = b.var(integer=False)
                if out:  # its gradient comes from the loss
                    self.ge(gl, (self.before(u, i), 1.0))
                for w in later:
                    self.ge(gl, (self.before(u, i), 1.0), (self.after(w, i), 1.0), (({}, 1.0), -1.0))
                terms[gl] = float(g.node(u)["out_bytes"])
            act = b.var(integer=False)
            b.row({act: 1.0, self.r[i]: -1.0, hold[i]: -1.0}, -1.0, float("inf"))
            self._mem_row(terms, 0.0, act)

    # -------------------------------------------------------------- backward checks
    def _pick_checks(self) -> list[int]:
        """Every node with an output gradient, or the ``max_checks`` of them whose backward is
        highest in the plan without recomputation (plus need) when there are more."""
        g = self.graph
        grad = has_grad(g)
        cands = [v for v in g.nodes if grad[v]]
        if self.max_checks is None:
            self.max_checks = len(g) if len(g) <= 40 else 8
        if self.max_terms is None:
            self.max_terms = len(g) if len(g) <= 40 else 48
        if len(cands) <= self.max_checks:
            return cands
        sim = simulate(g, no_recompute_plan(g), check=False, record=True)
        level = {v: live for phase, v, live in sim.timeline if phase == "bwd"}
        pb = g.meta.get("param_bytes", {})
        cands.sort(key=lambda v: -(level.get(v, 0) + _backward_need(g, v, pb)))
        return sorted(cands[: self.max_checks])

    def _order_var(self, w: int, v: int, done: bool, anc: list[int]) -> tuple[int | None, float]:
        """``(var, constant)`` for "``w``'s backward ran before ``v``'s" (``done``) or "is still to run"."""
        key = (w, v, done)
        got = self._order.get(key)
        if got is not None:
            return got
        if anc[v] >> w & 1:        # w before v in every plan: its backward runs after v's
            got = (None, 0.0 if done else 1.0)
        elif anc[w] >> v & 1:      # w after v in every plan
            got = (None, 1.0 if done else 0.0)
        else:
            var = self.b.var(integer=False)
            for i in range(self.k):
                xv = self.X(v, i)
                # done: s(w) > s(v) (w < v) or s(w) >= s(v) (w > v); pending: the complement
                ew = self.E(w, i + 1) if w < v else self.E(w, i)
                if done:
                    self.ge(var, (xv, 1.0), (ew, 1.0), (({}, 1.0), -1.0))
                else:
                    self.ge(var, (xv, 1.0), (ew, -1.0))
            got = (var, 0.0)
        self._order[key] = got
        return got

    def _backward_rows(self, deps: set[tuple[int, int]]) -> None:
        """At the backward of each checked node ``v`` (a node with an output gradient: its backward
        always allocates, so the simulator always checks the peak there): its plan-independent
        need (:func:`_backward_need`) plus the storages still saved by savers whose backward is
        still to run (plain ones, or recomputed ones of ``v``'s segment before ``v`` when ``v``
        holds something), inputs of recomputed segments up to ``v``'s, extras of plain savers to
        run, the own gradient buffers of nodes to run whose gradient-reading successors have run,
        and the parameter gradients of the nodes that have run."""
        g, k, b = self.graph, self.k, self.b
        n = len(g)
        anc = [0] * n
        preds: dict[int, list[int]] = {}
        for u, v in deps:
            preds.setdefault(v, []).append(u)
        for v in g.nodes:
            m = 0
            for u in preds.get(v, ()):
                m |= anc[u] | (1 << u)
            anc[v] = m
        self._order = {}
        pb = g.meta.get("param_bytes", {})
        grad = has_grad(g)
        alloc = [int(g.node(v)["alloc_bytes"]) for v in g.nodes]
        own = {u for u in g.nodes if g.node(u)["requires_grad"] and g.node(u)["out_bytes"] > 0
               and all(not g.node(w)["grad_passthrough"] for w in g.succ(u) if grad[w])}
        savers: dict[int, list[int]] = {}
        for w in g.nodes:
            dw = g.node(w)
            if dw["requires_grad"]:
                for r in {g.root(u) for u in dw["saves"]}:
                    if alloc[r] > 0:
                        savers.setdefault(r, []).append(w)
        puse = [(p, w) for w in g.nodes if grad[w] for p in set(g.node(w)["params"]) if p in pb]
        top = self.max_terms or n
        roots = sorted(set(savers) | {r for r, _ in self.cin}, key=lambda r: -alloc[r])[:top]
        own = set(sorted(own, key=lambda u: -g.node(u)["out_bytes"])[:top])
        extras = sorted((w for w in g.nodes if g.node(w)["requires_grad"] and g.node(w)["extra_saved_bytes"]),
                        key=lambda w: -g.node(w)["extra_saved_bytes"])[:top]
        for v in self.checks:
            dv = g.node(v)
            mine = {g.root(u) for u in dv["saves"]} if dv["requires_grad"] else set()
            terms: Expr = {}
            const = float(_backward_need(g, v, pb) + (dv["out_bytes"] if v in own else 0))
            for r in roots:
                if r in mine:
                    continue
                parts = []
                for w in savers.get(r, ()):
                    if w != v:
                        parts.append(w)
                if not parts and (r, 0) not in self.cin:
                    continue
                h = b.var(integer=False)
                used = False
                for w in parts:
                    var, c = self._order_var(w, v, False, anc)
                    pend = ({var: 1.0} if var is not None else {}, c)
                    self.ge(h, (pend, 1.0), (self.rec(w), -1.0))
                    used = True
                if (r, 0) in self.cin:
                    for i in range(k):
                        self.ge(h, (({self.cin[r, i]: 1.0}, 0.0), 1.0), (self.X(v, i), 1.0), (({}, 1.0), -1.0))
                    used = True
                if used:
                    terms[h] = float(alloc[r])
            for w in extras:
                dw = g.node(w)
                if w == v:
                    continue
                var, c = self._order_var(w, v, False, anc)
                xv = b.var(integer=False)
                self.ge(xv, (({var: 1.0} if var is not None else {}, c), 1.0), (self.rec(w), -1.0))
                terms[xv] = float(dw["extra_saved_bytes"])
            for u in own:
                if u == v:
                    continue
                later = [w for w in g.succ(u) if grad[w] and w != v]
                out = g.node(u)["is_output"]
                if not later and not out:
                    continue
                pv, pc = self._order_var(u, v, False, anc)
                gl = b.var(integer=False)
                if out:  # its gradient comes from the loss
                    self.ge(gl, (({pv: 1.0} if pv is not None else {}, pc), 1.0))
                for w in later:
                    dvar, dc = self._order_var(w, v, True, anc)
                    self.ge(gl, (({pv: 1.0} if pv is not None else {}, pc), 1.0),
                            (({dvar: 1.0} if dvar is not None else {}, dc), 1.0), (({}, 1.0), -1.0))
                terms[gl] = float(g.node(u)["out_bytes"])
            pg: dict[str, int] = {}
            for p, w in puse:
                if w == v:
                    continue
                if p not in pg:
                    pg[p] = b.var(integer=False)
                    terms[pg[p]] = float(pb[p])
                dvar, dc = self._order_var(w, v, True, anc)
                self.ge(pg[p], (({dvar: 1.0} if dvar is not None else {}, dc), 1.0))
            if _holder(dv) and (v, 0) in self.y:
                cp: dict[int, int] = {}
                for w in range(v):
                    dw = g.node(w)
                    if not _holder(dw) or (w, 0) not in self.y:
                        continue
                    for u in dw["saves"]:
                        if alloc[u] <= 0 or g.node(u)["alias_of"] is not None or u in mine:
                            continue
                        if not (u == w or u in g.pred(w)):
                            continue
                        if u not in cp:
                            cp[u] = b.var(integer=False)
                            terms[cp[u]] = float(alloc[u])
                        for i in range(k):
                            self.ge(cp[u], (({self.y[w, i]: 1.0, self.y[v, i]: 1.0}, 0.0), 1.0),
                                    (self.X(u, i), 1.0), (({}, 2.0), -1.0))
            self._mem_row(terms, const, None)

    def _mem_row(self, terms: Expr, const: float, act: int | None) -> None:
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


def _sub(a: tuple[Expr, float], b_: tuple[Expr, float]) -> tuple[Expr, float]:
    out = dict(a[0])
    for col, v in b_[0].items():
        out[col] = out.get(col, 0.0) - v
    return out, a[1] - b_[1]


def _lin(parts: list[tuple[Expr, float]]) -> tuple[Expr, float]:
    out: Expr = {}
    const = 0.0
    for t, c in parts:
        for col, a in t.items():
            out[col] = out.get(col, 0.0) + a
        const += c
    return out, const


def _merge(base: Expr, extra: Expr, sign: float) -> Expr:
    out = dict(base)
    for col, a in extra.items():
        out[col] = out.get(col, 0.0) + sign * a
    return out
