"""What an op's backward hands each input, where the cost model's default (a gradient of the input's
``out_bytes``, or the op's own when it passes it through) is not what autograd does.

* **Casts** (``grad_new``): a node that passes its gradient through gives an input of another
  floating dtype a new gradient, a copy in that dtype. Under autocast a residual ``add`` of a bf16
  block input and an fp32 branch (ConvNeXt's layer scale: an fp32 parameter times a bf16 tensor)
  hands its fp32 gradient to the branch and a bf16 copy to the input.
* **Parts of a split** (``grad_part``): an op reading one of the views a split made of a tensor
  (``chunk``, ``split``, ``unbind``: one op, several views of one storage) hands that view a gradient
  of the view's size; the split's backward joins them into one of the whole tensor when all are in
  (zeros for the missing ones). A GLU's ``gate, up = proj(x).chunk(2, -1)`` (Phi-3, Mixtral's
  experts, diffusers' GEGLU): the cost model gave each reader a gradient of the whole projection
  output, 1.05-1.08x the measured least-plan peak.
* **Views wider than their storage** (``grad_part`` too): an op computing something (not itself a
  view) that reads a view with more bytes than its storage (``expand``: the key/value heads of
  grouped-query attention repeated for each query head, Llama's ``repeat_kv``; ``as_strided`` with
  overlapping windows, Longformer's chunks) hands that view a gradient of the view's size, which
  the view's own backward reduces (``sum``) later. The cost model gave the input a gradient of its
  own size at once: a GQA stack was predicted 0.975x its least plan's measured peak, a Hugging Face
  Gemma-2 0.982x. Decision: the reader gives a part of the view's size, joined (freed) before the
  input's backward, as a split's parts are: high, by that part, between the view's backward and the
  input's, never low. A view reading a wide view hands its gradient on as a view and gives none.

:class:`InputGrads` notes what each op read and made while capture records the forward (the
tensors are the ones the model sees: a dispatch mode below autograd gets the same objects), and
:meth:`InputGrads.apply` writes the node records once backward has said which nodes pass their
gradient through.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["InputGrads"]


class InputGrads:
    """Casts, split parts and wide views read by each op node (module docstring)."""

    def __init__(self) -> None:
        self.casts: dict[int, set[int]] = {}
        """Op node -> the nodes whose outputs it read in another floating dtype than its own."""
        self.parts: dict[int, dict[int, int]] = {}
        """Op node -> {node: bytes of the split views of that node's output it read}."""
        self.wide: dict[int, dict[int, int]] = {}
        """Op node -> {node: bytes of the widest view of that node's output it read, where wider than
        the storage (``expand``, ``as_strided`` with overlapping windows)}."""
        self.held: dict[int, set[int]] = {}
        """Op node -> inputs it saves without reading them (:mod:`.unread_saves`): a part of 0 bytes."""
        self._views: dict[int, weakref.ref] = {}
        """``id`` of each view a split made -> a reference to it (an ``id`` may be reused)."""

    def note(self, v: int, ins: list[torch.Tensor], outs: list[torch.Tensor], owner: Mapping[int, int]) -> None:
        """Op node ``v`` read ``ins`` and made ``outs``; ``owner``: storage key -> the node that owns it."""
        dtype = next((t.dtype for t in outs if t.is_floating_point()), None)
        for t in ins:
            u = owner.get(t.untyped_storage()._cdata)
            if u is None:
                continue
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                self.casts.setdefault(v, set()).add(u)
            nominal = t.numel() * t.element_size()
            if nominal > t.untyped_storage().nbytes():  # wider than its storage: expanded, overlapping windows
                wide = self.wide.setdefault(v, {})
                wide[u] = max(wide.get(u, 0), nominal)
            ref = self._views.get(id(t))
            if ref is not None and ref() is t:
                parts = self.parts.setdefault(v, {})
                parts[u] = parts.get(u, 0) + t.numel() * t.element_size()
        keys = {t.untyped_storage()._cdata for t in outs}
        if len(outs) > 1 and len(keys) == 1 and keys <= {t.untyped_storage()._cdata for t in ins}:
            for t in outs:  # one op, several views of an input's storage: a split
                self._views[id(t)] = weakref.ref(t)

    def apply(self, nodes: list[Any]) -> None:
        """Set ``grad_new`` (a pass-through node's inputs of another dtype) and ``grad_part`` (the split
        views, and the views wider than their storage, a node that makes its inputs' gradients read)
        of the node records ``nodes``."""
        for w, inputs in self.casts.items():
            rec = nodes[w]
            if rec.grad_passthrough:
                rec.grad_new = sorted(u for u in inputs if u in rec.preds and nodes[u].requires_grad)
        for w in self.parts.keys() | self.wide.keys() | self.held.keys():
            rec = nodes[w]
            part = {u: 0 for u in self.held.get(w, ())}
            if rec.grad_passthrough:
                rec.grad_part = sorted((u, b) for u, b in part.items() if nodes[u].requires_grad)
                continue
            part.update({u: b for u, b in self.parts.get(w, {}).items() if b < nodes[u].out_bytes})
            if rec.alias_of is None:  # an op computing something; a view of a view hands its gradient on as a view
                part.update({u: b for u, b in self.wide.get(w, {}).items() if b > nodes[u].out_bytes})
            rec.grad_part = sorted((u, b) for u, b in part.items() if u in rec.preds and nodes[u].requires_grad)
