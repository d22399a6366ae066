"""What a node's backward hands its inputs: the simulator's gradient rules.

A node that receives a gradient allocates one for each input that requires grad (a new buffer;
out of place beside a buffer another reader shares; added in place, a transient, into one it
holds alone), passes its own on where it is a pass-through op (``add``, views of an fx graph),
gives a *part* where a split made the input (``grad_part``) and a new cast where autocast's
``grad_new`` says so (:func:`input_grads`).

The engine adds into a buffer only where it owns it alone *and* it is dense and no view
(``can_accumulate_inplace``, PyTorch's ``input_buffer.cpp``). A first gradient that a reader's
backward hands on as a view of its own buffer (a transpose or reshape closing the reader's
backward) is summed with the second out of place: the sum is a third buffer while both parts
live, then the only one. The engine sums once the second giver's backward is done, so its
workspace is gone by then: the level there is the larger of the two moments. Capture measures
which nodes get such a first gradient (``first_grad_view``, from the engine's own sums); the state
keeps the nodes whose gradient is still that first one (:attr:`~.ledger.StepState.viewed`). Measured (CPU, Hugging Face
``SpeechT5ForSpeechToText``, op by op): the relative position embedding every encoder layer
reads gets its first gradient through a transpose; the least plan's peak falls on that sum,
predicted 0.903x of the measured peak without the rule.

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


def input_grads(s: StepState, g: Graph, nd: list[dict], v: int, gv: Hashable) -> tuple[int, int]:
    """The gradients node ``v``'s backward hands its inputs; returns the transient bytes (new ones
    summed, freed) and those of the first parts alive through sums out of place, where the first was a
    view: the engine sums once ``v``'s backward is done, its workspace gone, so the caller adds the
    larger of the workspace and those bytes."""
    d = nd[v]
    transient = first = 0
    parts = dict(d["grad_part"]) if d["grad_part"] else {}
    for u in g.pred(v):
        du = nd[u]
        if not du["requires_grad"]:
            continue
        if u in parts:  # a part of u's output that a split made: its gradient, joined before u's backward
            s.give_part(u, parts[u], v)
            continue
        old = s.grad.get(u)
        passes = d["grad_passthrough"] and u not in d["grad_new"]  # else a new one (a cast to u's dtype)
        if old is None:
            if du["first_grad_view"]:
                s.viewed.add(u)
            if passes:
                s.addref(gv, ("gb", u))
                s.grad[u] = gv
            else:
                new = s.new_grad(du["out_bytes"])
                s.addref(new, ("gb", u))
                s.grad[u] = new
            continue
        viewed, alone = u in s.viewed, len(s.refs[old]) == 1
        s.viewed.discard(u)
        if alone and not viewed and not passes:
            transient += du["out_bytes"]  # new gradient, added in place, freed
            continue
        if viewed and alone:  # summed out of place: the first lives through the sum, then goes
            first += s.size[old]
        if not passes:
            transient += du["out_bytes"]  # the new gradient, summed out of place
        new = s.new_grad(du["out_bytes"])  # (a pass-through's own, held by v, is the other part)
        s.addref(new, ("gb", u))
        s.grad[u] = new
        s.decref(old, ("gb", u))
    return transient, first


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
