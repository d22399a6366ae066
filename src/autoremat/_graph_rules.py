"""Rules of :class:`autoremat.graph.Graph` that capture applies too, without a graph: how long
the step keeps the model's returned object (:data:`OUTPUT_KEPT`), the size of the gradient the
loss seeds into a model output (:func:`grad_bytes_of`), and the form of a node's ``lingering``
and ``grad_part`` bytes (:func:`byte_pairs`, :func:`scaled_pairs`).

The seed. ``out.sum()`` hands ``out`` an expanded scalar (one element of storage, strides 0),
``out.mean()`` (PyTorch 2.13: ``mean_backward`` divides the expanded gradient) and a
cross-entropy hand it a dense gradient of ``out_bytes``. Capture records the storage bytes of what
the loss hands each output, where smaller (``grad_seed_bytes``, :mod:`.capture._loss_reach`). The
cost models use it only where the seed stays the output's whole gradient until its backward:

* an output that a node requiring grad also reads gets that node's gradient added to its seed;
  nothing can be added in place into an expanded tensor, so from then on the gradient is dense
  (traced under a dispatch mode: ``aten.add`` of the seed and the contribution, a new buffer of
  ``out_bytes``; the engine without a mode may add the seed into the contribution instead). The
  models price such an output's gradient at ``out_bytes`` from the loss on: high by up to
  ``out_bytes`` between the loss and that node's backward, never low;
* an output whose backward passes its gradient on (``grad_passthrough``: a view, an ``add``)
  would hand the expanded seed to its inputs, which the models size with their own ``out_bytes``:
  it keeps ``out_bytes`` too (high, never low).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["OUTPUT_KEPT", "check_output_kept", "grad_bytes_of", "input_nodes", "byte_pairs", "scaled_pairs",
           "scale_sparse_grads"]

OUTPUT_KEPT = ("loss", "step")
"""Values of ``Graph.meta["output_kept"]``: until when the step keeps the model's returned object."""


def check_output_kept(value: Any, name: str = "output_kept") -> str:
    """``value`` if it is one of :data:`OUTPUT_KEPT`, else a ``ValueError`` naming ``name``."""
    if value not in OUTPUT_KEPT:
        raise ValueError(f"{name}={value!r} is not one of {OUTPUT_KEPT}: 'step' when the loop keeps the model's "
                         "returned object through backward (outputs = model(**batch); accelerator.backward("
                         "outputs.loss)), 'loss' when it drops it once the loss is computed (loss = "
                         "model(**batch).loss; Lightning's training_step returning the loss)")
    return str(value)


def grad_bytes_of(out_bytes: int, grad_seed_bytes: int | None, *, is_output: bool, passthrough: bool,
                  read_with_grad: bool) -> int:
    """Bytes of a node's output gradient: ``out_bytes``, or the loss's seed ``grad_seed_bytes``
    (at most ``out_bytes``) for a model output that no node requiring grad reads
    (``read_with_grad`` false) and whose backward makes new input gradients (module docstring)."""
    if grad_seed_bytes is None or not is_output or passthrough or read_with_grad:
        return int(out_bytes)
    return min(int(grad_seed_bytes), int(out_bytes))


def byte_pairs(pairs: Iterable[Iterable[int]], v: int, name: str,
               nodes: Iterable[int] | None = None) -> tuple[tuple[int, int], ...]:
    """Node ``v``'s attribute ``name`` as ``(node, bytes)`` pairs of ints, each node once and run before
    ``v`` (``lingering``: the makers, :mod:`autoremat.capture.lingering`), or one of ``nodes`` (``grad_part``:
    its inputs); a ``ValueError`` otherwise."""
    out = tuple((int(u), int(b)) for u, b in pairs)
    if not out:  # most nodes: nothing to check (and no set of every earlier node per node)
        return out
    named = [u for u, _ in out]
    ok = all(0 <= u < v for u in named) if nodes is None else set(nodes).issuperset(named)
    if not ok or len(set(named)) < len(named):
        raise ValueError(f"node {v}'s {name} names nodes {named}: each must be "
                         f"{'a node run before it' if nodes is None else 'one of its inputs'}, once")
    return out


def scaled_pairs(pairs: Iterable[tuple[int, int]], scale: Any) -> tuple[tuple[int, int], ...]:
    """``pairs`` with each byte count ``b`` replaced by ``ceil(scale(b))`` (at least 0)."""
    return tuple((u, max(0, int(math.ceil(scale(b))))) for u, b in pairs)


def input_nodes(nodes: Iterable[int], v: int, preds: Iterable[int], name: str) -> tuple[int, ...]:
    """Node ``v``'s attribute ``name`` listing some of its inputs ``preds``, sorted; a ``ValueError`` otherwise."""
    out, inputs = tuple(sorted({int(u) for u in nodes})), set(preds)
    if not inputs.issuperset(out):
        raise ValueError(f"node {v}'s {name} names {sorted(set(out) - inputs)}, which are not its inputs")
    return out


def scale_sparse_grads(meta: dict[str, Any], nodes: Iterable[dict[str, Any]], scale: Any) -> None:
    """``meta["param_bytes"]`` of the parameters whose gradient is sparse (``meta["sparse_grad_params"]``:
    one row per lookup, so it grows with the batch; :mod:`autoremat.capture.sparse_grads`) set to
    ``ceil(scale(name, bytes))``, and the ``param_grad_bytes`` of the nodes using them summed again."""
    sparse = set(meta.get("sparse_grad_params", ()))
    if not sparse:
        return
    pb = meta["param_bytes"]
    for name in sparse:
        pb[name] = max(0, int(math.ceil(scale(name, pb[name]))))
    for d in nodes:
        if sparse & set(d["params"]):
            d["param_grad_bytes"] = int(sum(pb.get(p, 0) for p in d["params"]))
