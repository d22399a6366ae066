"""Plan-independent facts of a graph that the ``milp`` program reads, and its expression helpers.

An expression is ``(terms, constant)``: ``terms`` maps a column of the program to its coefficient.
"""

from __future__ import annotations

from ...graph import Graph

__all__ = ["Expr", "has_grad", "holder", "backward_need", "constant_floor", "sub", "lin", "merge"]

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


def holder(d: dict) -> bool:
    return bool(d["requires_grad"] and (d["saves"] or d["extra_saved_bytes"]))


def backward_need(g: Graph, v: int, pb: dict) -> int:
    """What node ``v``'s backward has live whatever the plan: its saved storages and extras, its
    workspace, its parameters' gradients and (unless it passes its gradient through) its inputs'."""
    d = g.node(v)
    saved = sum(g.node(r)["alloc_bytes"] for r in {g.root(u) for u in d["saves"]}) if d["requires_grad"] else 0
    extra = d["extra_saved_bytes"] if d["requires_grad"] else 0
    given = d["grad_new"] if d["grad_passthrough"] else g.pred(v)  # a pass-through gives new ones to grad_new only
    part = dict(d["grad_part"])  # a split's view: the view's size
    grads = sum(part.get(u, g.grad_bytes(u)) for u in given if g.node(u)["requires_grad"])
    params = sum(pb[p] for p in set(d["params"]) if p in pb)
    return int(saved + extra + grads + params + d["bwd_temp_bytes"])


def constant_floor(graph: Graph) -> int:
    """A plan-independent lower bound of the simulated step peak (see the module docstring)."""
    g = graph
    pb = g.meta.get("param_bytes", {})
    grad = has_grad(g)
    meta = g.meta
    held = meta["loss_held_bytes"]  # the loss tensor: alive from the loss to the step's end
    best = 0
    for v in g.nodes:
        d = g.node(v)
        roots = {g.root(u) for u in g.pred(v)}
        if d["alias_of"] is None:
            roots.add(v)
        fwd = sum(g.node(r)["alloc_bytes"] for r in roots) + d["extra_saved_bytes"] + d["fwd_temp_bytes"]
        best = max(best, fwd)
        if grad[v]:
            best = max(best, backward_need(g, v, pb) + held)
    outs = g.held_roots()
    best = max(best, sum(g.node(r)["alloc_bytes"] for r in outs) + meta["loss_extra_bytes"] + held
               + meta["loss_fwd_temp_bytes"])
    ograds = sum(g.grad_bytes(v) for v in g.nodes if g.node(v)["is_output"] and g.node(v)["requires_grad"])
    lsaves = sum(g.node(r)["alloc_bytes"] for r in {g.root(u) for u in meta["loss_saves"]})
    return int(max(best, ograds + lsaves + held + meta["loss_bwd_temp_bytes"]))


def sub(a: tuple[Expr, float], b_: tuple[Expr, float]) -> tuple[Expr, float]:
    out = dict(a[0])
    for col, v in b_[0].items():
        out[col] = out.get(col, 0.0) - v
    return out, a[1] - b_[1]


def lin(parts: list[tuple[Expr, float]]) -> tuple[Expr, float]:
    out: Expr = {}
    const = 0.0
    for t, c in parts:
        for col, a in t.items():
            out[col] = out.get(col, 0.0) + a
        const += c
    return out, const


def merge(base: Expr, extra: Expr, sign: float) -> Expr:
    out = dict(base)
    for col, a in extra.items():
        out[col] = out.get(col, 0.0) + sign * a
    return out
