"""What a node's backward hands its inputs: the simulator's gradient rules.

A node that receives a gradient allocates one for each input that requires grad (a new buffer;
out of place beside a buffer another reader shares; added in place, a transient, into one it
holds alone), passes its own on where it is a pass-through op (``add``, views of an fx graph),
gives a *part* where a split made the input (``grad_part``) and a new cast where autocast's
``grad_new`` says so (:func:`input_grads`).

A view captured at module level has no readers of its own: its readers link to the storage owner
(the root), and the cost model hands their gradients to the root directly. Its backward still runs
(after its readers', before the root's: the node order), and most views' backward is a view or a
gradient of the input's size, which the root's accumulation already counts. An overlapping
``as_strided`` (Longformer's sliding-window chunks, ``Tensor.unfold``) runs a slow backward instead:
an index tensor and a copy beside the input's gradient, which capture measures as the view's
``bwd_temp_bytes``. Where a view has such workspace and its root holds a gradient when its place
in backward comes (some reader handed one, :func:`reader_less_view_runs`), the step touches its
input's gradient plus that workspace there (:func:`view_backward_bytes`). Measured (CPU, Hugging
Face ``LongformerForMaskedLM``, 2 layers, sequence 32, window 8): the least plan's peak fell in
such a backward of a replayed layer, predicted 0.899x of the measured peak without the rule.
:mod:`.segment_replay` mirrors it.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..graph import Graph
from .ledger import StepState

__all__ = ["input_grads", "reader_less_view_runs", "view_backward_bytes"]


def input_grads(s: StepState, g: Graph, nd: list[dict], v: int, gv: Hashable) -> int:
    """The gradients node ``v``'s backward hands its inputs; returns the transient bytes (new ones added in place)."""
    d = nd[v]
    transient = 0
    parts = dict(d["grad_part"]) if d["grad_part"] else {}
    for u in g.pred(v):
        du = nd[u]
        if not du["requires_grad"]:
            continue
        if u in parts:  # a part of u's output that a split made: its gradient, joined before u's backward
            s.give_part(u, parts[u], v)
            continue
        old = s.grad.get(u)
        if d["grad_passthrough"] and u not in d["grad_new"]:  # else a new one (a cast to u's dtype)
            if old is None:
                s.addref(gv, ("gb", u))
                s.grad[u] = gv
            else:
                new = s.new_grad(du["out_bytes"])
                s.addref(new, ("gb", u))
                s.grad[u] = new
                s.decref(old, ("gb", u))
        elif old is None:
            new = s.new_grad(du["out_bytes"])
            s.addref(new, ("gb", u))
            s.grad[u] = new
        elif len(s.refs[old]) == 1:
            transient += du["out_bytes"]  # new gradient, added in place, freed
        else:
            transient += du["out_bytes"]
            new = s.new_grad(du["out_bytes"])
            s.addref(new, ("gb", u))
            s.grad[u] = new
            s.decref(old, ("gb", u))
    return transient


def reader_less_view_runs(s: StepState, g: Graph, nd: list[dict], v: int) -> bool:
    """Whether node ``v``, which gets no gradient of its own in the model, is a view whose backward
    runs with workspace now: its root holds a gradient its readers handed it (module docstring)."""
    d = nd[v]
    if not (d["bwd_temp_bytes"] and d["alias_of"] is not None and d["requires_grad"]):
        return False
    root = g.root(v)
    return root in s.grad or root in s.parts


def view_backward_bytes(g: Graph, nd: list[dict], v: int) -> int:
    """The transient bytes of such a view's backward: its inputs' gradients (the input's size, as capture
    models them when it derives ``bwd_temp_bytes``) and its workspace."""
    return sum(int(nd[u]["out_bytes"]) for u in g.pred(v) if nd[u]["requires_grad"]) + int(nd[v]["bwd_temp_bytes"])
