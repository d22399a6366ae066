"""Tensors a node saves for its backward without reading them in forward.

An op node's saves are what its autograd node keeps; its inputs are what the recorder saw it read
(below autograd, the tensors the kernels get). The two differ in two ways the cost model must see:

* **Made for the backward only**: autograd copies the original ``self`` of an in-place op before
  the op runs (Mixtral's router, ``top_value /= top_value.sum(...)``, dispatches a ``clone`` before
  its ``div_``): a node output nobody reads. It is the saver's extra saved bytes: it lives from the
  saver's forward to its backward, not from a producer whose output nobody holds.
* **Read through a copy**: an op called with a conjugate view (Autoformer's auto-correlation,
  ``q_fft * torch.conj(k_fft)``) runs on a copy the conjugate fallback makes below autograd (a
  ``clone`` node the op reads), while autograd saves the view, whose storage is the FFT's output.
  Without an edge that output's last reader was the copy: the simulator freed it before the saver
  saved it (``KeyError`` on the Hugging Face Autoformer). The saver gets it as an input, which
  holds it to the saver's forward, with a gradient part of 0 bytes
  (:mod:`autoremat.capture.input_grads`): the gradient reaches it through the copy, as the cost model
  already gives it (autograd's reaches it through the view's ``ConjBackward``: one gradient either way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["settle_unread_saves"]


def settle_unread_saves(nodes: list[Any], succs: dict[int, list[int]], root: Callable[[int], int],
                        held: dict[int, set[int]]) -> None:
    """Fold the saves made for the backward only into extra saved bytes, and make the saves read
    through a copy inputs of their saver (module docstring); ``held``: saver -> those inputs, for
    :class:`~autoremat.capture.input_grads.InputGrads`."""
    for v, rec in enumerate(nodes):
        read = {root(p) for p in rec.preds} | {root(v)}
        for u in sorted(rec.saves):
            if root(u) in read:
                continue
            if not succs.get(u) and nodes[u].alias_of is None:
                rec.saves.discard(u)
                rec.extra_saved_bytes += nodes[u].alloc_bytes
            else:
                rec.preds.append(u)
                succs.setdefault(u, []).append(v)
                held.setdefault(v, set()).add(u)
                read.add(root(u))
