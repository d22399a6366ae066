"""The memory rows of the ``milp`` program (see :mod:`.formulation` for what they bound).

Each function adds rows to a :class:`~.formulation.Formulation` under construction: the loss
and replay checks (:func:`memory_rows`) and the backward checks (:func:`backward_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...cost import no_recompute_plan, simulate
from .facts import Expr, backward_need, has_grad, holder

if TYPE_CHECKING:
    from .formulation import Formulation

__all__ = ["Storages", "memory_rows", "backward_rows", "pick_checks"]


@dataclass
class Storages:
    """Who holds which storage root, whatever the plan: savers (nodes that save it and require
    grad) and the edges that make it an input of a segment; ``alloc`` per node."""

    alloc: list[int]
    savers: dict[int, list[int]]
    inputs: dict[int, list[tuple[int, int]]]
    extras: list[int]
    kept: set[int]
    """Roots the returned object holds to the end of backward (``Graph.held_to_end``: empty unless
    ``meta["output_kept"]`` is ``"step"``): alive in every loss, replay and backward row, whatever
    the plan, so a constant there and no variable."""

    @classmethod
    def of(cls, f: Formulation) -> "Storages":
        g = f.graph
        alloc = [int(g.node(v)["alloc_bytes"]) for v in g.nodes]
        savers: dict[int, list[int]] = {}
        for w in g.nodes:
            dw = g.node(w)
            if dw["requires_grad"]:
                for r in {g.root(u) for u in dw["saves"]}:
                    if alloc[r] > 0:
                        savers.setdefault(r, []).append(w)
        inputs: dict[int, list[tuple[int, int]]] = {}
        for u, w in g.nx.edges:
            r = g.root(u)
            if alloc[r] > 0 and g.node(w)["recomputable"]:
                inputs.setdefault(r, []).append((u, w))
        extras = [w for w in g.nodes if g.node(w)["requires_grad"] and g.node(w)["extra_saved_bytes"]]
        kept = g.held_roots(to_end=True)
        return cls(alloc, savers, inputs, extras, {r for r in kept if alloc[r] > 0})


def memory_rows(f: Formulation, hold: list[int]) -> Storages:
    """``cin[r,i]`` (root ``r`` is an input of a recomputed segment up to ``i``), the loss rows and
    the replay rows; returns the storage facts for :func:`backward_rows`."""
    st = Storages.of(f)
    b = f.b
    cin = f.cin = {}
    for r, edges in st.inputs.items():
        for i in range(f.k):
            c = cin[r, i] = b.var(integer=False)
            if i:
                b.row({c: 1.0, cin[r, i - 1]: -1.0}, 0.0, float("inf"))
            for u, w in edges:
                f.ge(c, (({f.y[w, i]: 1.0}, 0.0), 1.0), (f.X(u, i), -1.0))
    _loss_rows(f, st)
    _replay_rows(f, st, hold)
    return st


def _loss_rows(f: Formulation, st: Storages) -> None:
    """The loss forward (outputs alive) and backward (outputs' gradients, loss saves)."""
    g, k, b, cin = f.graph, f.k, f.b, f.cin
    alloc, savers, inputs, extras = st.alloc, st.savers, st.inputs, st.extras
    outs = g.held_roots()  # alive at the loss
    lsaves = {g.root(u) for u in g.meta["loss_saves"]}
    fwd: Expr = {}
    bwd: Expr = {}
    held = g.meta["loss_held_bytes"]  # the loss tensor's storage: from the loss to the step's end
    fconst = float(g.meta["loss_extra_bytes"] + held + g.meta["loss_fwd_temp_bytes"])
    bconst = float(g.meta["loss_extra_bytes"] + held + g.meta["loss_bwd_temp_bytes"])
    bconst += sum(g.grad_bytes(v) for v in g.nodes if g.node(v)["is_output"] and g.node(v)["requires_grad"])
    for r in set(savers) | set(inputs) | outs | lsaves:
        if alloc[r] == 0:
            continue
        if r in outs:
            fconst += alloc[r]
        if r in lsaves or r in st.kept:
            bconst += alloc[r]
        if (r in outs and (r in lsaves or r in st.kept)) or (r not in savers and r not in inputs):
            continue
        live = b.var(integer=False)
        for w in savers.get(r, ()):
            f.ge(live, (({}, 1.0), 1.0), (f.rec(w), -1.0))
        if r in cin:
            f.ge(live, (({cin[r, k - 1]: 1.0}, 0.0), 1.0))
        if r not in outs:
            fwd[live] = float(alloc[r])
        if r not in lsaves:
            bwd[live] = float(alloc[r])
    for w in extras:
        xb = float(g.node(w)["extra_saved_bytes"])
        fconst += xb
        bconst += xb
        for col, a in f.rec(w)[0].items():
            fwd[col] = fwd.get(col, 0.0) - a * xb
            bwd[col] = bwd.get(col, 0.0) - a * xb
    f.mem_row(fwd, fconst, None)
    f.mem_row(bwd, bconst, None)


def _replay_rows(f: Formulation, st: Storages, hold: list[int]) -> None:
    """At the replay of each recomputed segment with a holder (``act``: recomputed and holding)."""
    g, k, b, cin = f.graph, f.k, f.b, f.cin
    alloc, savers, inputs, extras = st.alloc, st.savers, st.inputs, st.extras
    pb = g.meta.get("param_bytes", {})
    grad = has_grad(g)
    copies = [(u, w) for w in g.nodes if holder(g.node(w)) for u in g.node(w)["saves"]
              if alloc[u] > 0 and g.node(u)["alias_of"] is None and (u == w or u in g.pred(w))
              and (w, 0) in f.y]
    own = [u for u in g.nodes if g.node(u)["requires_grad"]
           and all(not g.node(w)["grad_passthrough"] or u in g.node(w)["grad_new"] for w in g.succ(u) if grad[w])]
    puse = [(p, v) for v in g.nodes if grad[v] for p in set(g.node(v)["params"]) if p in pb]
    kept = float(sum(alloc[r] for r in st.kept) + g.meta["loss_held_bytes"])  # and the loss tensor
    for i in range(k):
        terms: Expr = {}
        for r in (set(savers) | set(inputs)) - st.kept:
            held = b.var(integer=False)
            for w in savers.get(r, ()):
                f.ge(held, (f.before(w, i), 1.0), (f.rec(w), -1.0))
            if r in cin:
                f.ge(held, (({cin[r, i]: 1.0}, 0.0), 1.0))
            terms[held] = float(alloc[r])
        for w in extras:
            xb = b.var(integer=False)
            f.ge(xb, (f.before(w, i), 1.0), (f.rec(w), -1.0))
            terms[xb] = float(g.node(w)["extra_saved_bytes"])
        cp: dict[int, int] = {}
        for u, w in copies:
            if u not in cp:
                cp[u] = b.var(integer=False)
                terms[cp[u]] = float(alloc[u])
            f.ge(cp[u], (({f.y[w, i]: 1.0}, 0.0), 1.0), (f.X(u, i), 1.0), (({}, 1.0), -1.0))
        pg: dict[str, int] = {}
        for p, v in puse:
            if p not in pg:
                pg[p] = b.var(integer=False)
                terms[pg[p]] = float(pb[p])
            f.ge(pg[p], (f.after(v, i), 1.0))
        for u in own:
            later = [w for w in g.succ(u) if grad[w]]
            out = g.node(u)["is_output"]
            if not (later or out) or g.grad_bytes(u) <= 0 or i == 0:
                continue
            gl = b.var(integer=False)
            if out:  # its gradient comes from the loss
                f.ge(gl, (f.before(u, i), 1.0))
            for w in later:
                f.ge(gl, (f.before(u, i), 1.0), (f.after(w, i), 1.0), (({}, 1.0), -1.0))
            terms[gl] = float(g.grad_bytes(u))
        act = b.var(integer=False)
        b.row({act: 1.0, f.r[i]: -1.0, hold[i]: -1.0}, -1.0, float("inf"))
        f.mem_row(terms, kept, act)


def pick_checks(f: Formulation) -> list[int]:
    """Every node with an output gradient, or the ``max_checks`` of them whose backward is
    highest in the plan without recomputation (plus need) when there are more."""
    g = f.graph
    grad = has_grad(g)
    cands = [v for v in g.nodes if grad[v]]
    if f.max_checks is None:
        f.max_checks = len(g) if len(g) <= 40 else 8
    if f.max_terms is None:
        f.max_terms = len(g) if len(g) <= 40 else 48
    if len(cands) <= f.max_checks:
        return cands
    sim = simulate(g, no_recompute_plan(g), check=False, record=True)
    level = {v: live for phase, v, live in sim.timeline if phase == "bwd"}
    pb = g.meta.get("param_bytes", {})
    cands.sort(key=lambda v: -(level.get(v, 0) + backward_need(g, v, pb)))
    return sorted(cands[: f.max_checks])

def _order_var(f: Formulation, w: int, v: int, done: bool, anc: list[int]) -> tuple[int | None, float]:
    """``(var, constant)`` for "``w``'s backward ran before ``v``'s" (``done``) or "is still to run"."""
    key = (w, v, done)
    got = f._order.get(key)
    if got is not None:
        return got
    if anc[v] >> w & 1:        # w before v in every plan: its backward runs after v's
        got = (None, 0.0 if done else 1.0)
    elif anc[w] >> v & 1:      # w after v in every plan
        got = (None, 1.0 if done else 0.0)
    else:
        var = f.b.var(integer=False)
        for i in range(f.k):
            xv = f.X(v, i)
            # done: s(w) > s(v) (w < v) or s(w) >= s(v) (w > v); pending: the complement
            ew = f.E(w, i + 1) if w < v else f.E(w, i)
            if done:
                f.ge(var, (xv, 1.0), (ew, 1.0), (({}, 1.0), -1.0))
            else:
                f.ge(var, (xv, 1.0), (ew, -1.0))
        got = (var, 0.0)
    f._order[key] = got
    return got

@dataclass
class _Backward:
    """What every backward row reads (set up once per program)."""

    anc: list[int]
    pb: dict
    grad: list[bool]
    alloc: list[int]
    savers: dict[int, list[int]]
    own: set[int]
    puse: list[tuple[str, int]]
    roots: list[int]
    extras: list[int]
    kept: set[int]


def backward_rows(f: Formulation, deps: set[tuple[int, int]], st: Storages) -> None:
    """At the backward of each checked node ``v`` (a node with an output gradient: its backward
    always allocates, so the simulator always checks the peak there): its plan-independent
    need (:func:`.facts.backward_need`) plus the storages still saved by savers whose backward is
    still to run (plain ones, or recomputed ones of ``v``'s segment before ``v`` when ``v``
    holds something), inputs of recomputed segments up to ``v``'s, extras of plain savers to
    run, the own gradient buffers of nodes to run whose gradient-reading successors have run,
    and the parameter gradients of the nodes that have run."""
    g = f.graph
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
    f._order = {}
    pb = g.meta.get("param_bytes", {})
    grad = has_grad(g)
    alloc = st.alloc
    own = {u for u in g.nodes if g.node(u)["requires_grad"] and g.grad_bytes(u) > 0
           and all(not g.node(w)["grad_passthrough"] or u in g.node(w)["grad_new"] for w in g.succ(u) if grad[w])}
    puse = [(p, w) for w in g.nodes if grad[w] for p in set(g.node(w)["params"]) if p in pb]
    top = f.max_terms or n
    roots = sorted((set(st.savers) | {r for r, _ in f.cin}) - st.kept, key=lambda r: -alloc[r])[:top]
    own = set(sorted(own, key=lambda u: -g.grad_bytes(u))[:top])
    extras = sorted(st.extras, key=lambda w: -g.node(w)["extra_saved_bytes"])[:top]
    ctx = _Backward(anc, pb, grad, alloc, st.savers, own, puse, roots, extras, st.kept)
    for v in f.checks:
        _backward_row(f, ctx, v)


def _backward_row(f: Formulation, ctx: _Backward, v: int) -> None:
    """Long by design: one row of the program, whose terms are built in the order of the
    simulator's events at that node."""
    g, k, b = f.graph, f.k, f.b
    anc, pb, grad, alloc, savers = ctx.anc, ctx.pb, ctx.grad, ctx.alloc, ctx.savers
    own, puse, roots, extras = ctx.own, ctx.puse, ctx.roots, ctx.extras
    dv = g.node(v)
    mine = {g.root(u) for u in dv["saves"]} if dv["requires_grad"] else set()
    terms: Expr = {}
    const = float(backward_need(g, v, pb) + (g.grad_bytes(v) if v in own else 0))
    const += sum(alloc[r] for r in ctx.kept if r not in mine)  # held by the returned object throughout
    const += g.meta["loss_held_bytes"]  # the loss tensor, too
    for r in roots:
        if r in mine:
            continue
        parts = []
        for w in savers.get(r, ()):
            if w != v:
                parts.append(w)
        if not parts and (r, 0) not in f.cin:
            continue
        h = b.var(integer=False)
        used = False
        for w in parts:
            var, c = _order_var(f, w, v, False, anc)
            pend = ({var: 1.0} if var is not None else {}, c)
            f.ge(h, (pend, 1.0), (f.rec(w), -1.0))
            used = True
        if (r, 0) in f.cin:
            for i in range(k):
                f.ge(h, (({f.cin[r, i]: 1.0}, 0.0), 1.0), (f.X(v, i), 1.0), (({}, 1.0), -1.0))
            used = True
        if used:
            terms[h] = float(alloc[r])
    for w in extras:
        dw = g.node(w)
        if w == v:
            continue
        var, c = _order_var(f, w, v, False, anc)
        xv = b.var(integer=False)
        f.ge(xv, (({var: 1.0} if var is not None else {}, c), 1.0), (f.rec(w), -1.0))
        terms[xv] = float(dw["extra_saved_bytes"])
    for u in own:
        if u == v:
            continue
        later = [w for w in g.succ(u) if grad[w] and w != v]
        out = g.node(u)["is_output"]
        if not later and not out:
            continue
        pv, pc = _order_var(f, u, v, False, anc)
        gl = b.var(integer=False)
        if out:  # its gradient comes from the loss
            f.ge(gl, (({pv: 1.0} if pv is not None else {}, pc), 1.0))
        for w in later:
            dvar, dc = _order_var(f, w, v, True, anc)
            f.ge(gl, (({pv: 1.0} if pv is not None else {}, pc), 1.0),
                    (({dvar: 1.0} if dvar is not None else {}, dc), 1.0), (({}, 1.0), -1.0))
        terms[gl] = float(g.grad_bytes(u))
    pg: dict[str, int] = {}
    for p, w in puse:
        if w == v:
            continue
        if p not in pg:
            pg[p] = b.var(integer=False)
            terms[pg[p]] = float(pb[p])
        dvar, dc = _order_var(f, w, v, True, anc)
        f.ge(pg[p], (({dvar: 1.0} if dvar is not None else {}, dc), 1.0))
    if holder(dv) and (v, 0) in f.y:
        cp: dict[int, int] = {}
        for w in range(v):
            dw = g.node(w)
            if not holder(dw) or (w, 0) not in f.y:
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
                    f.ge(cp[u], (({f.y[w, i]: 1.0, f.y[v, i]: 1.0}, 0.0), 1.0),
                            (f.X(u, i), 1.0), (({}, 2.0), -1.0))
    f.mem_row(terms, const, None)
