"""What an autograd node keeps for its backward, read from the node itself (the module-level
capture's saves of an op of a block, :meth:`autoremat.capture.module._ModuleRecorder._read_saves`).

An in-place op on a view (``nn.ReLU(inplace=True)`` after a linear layer whose output was reshaped:
Swin v2's continuous position-bias MLP) gives the view a regenerated view node
(``AsStridedBackward0``) whose input is a ``CopySlices`` wrapping the op's own backward, which
Python cannot read: :func:`behind_copy_slices` tells, and the capture then takes the op to save its
result (ReLU's backward reads it), unless its backward reads neither its input nor its result
(:data:`NO_SAVES`: ``add_``, ``mul_`` by a scalar, ...; a residual ``m += a`` on a linear layer's output,
Falcon's parallel residual). For another op that saves nothing the write's storage is held a little
longer than needed: high, never low. Without it the storage was freed at its last reader's backward,
before the ReLU's, and Swin v2's unpatched step was predicted 0.94x its measured peak."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NO_SAVES", "behind_copy_slices", "saved_by"]


def saved_by(fn: Any) -> list[torch.Tensor]:
    """The tensors autograd node ``fn`` keeps for its backward: its ``_saved_*`` fields, or a custom
    ``autograd.Function``'s ``saved_tensors``."""
    values: list[Any] = []
    names = [n for n in dir(fn) if n.startswith("_saved_")]
    if isinstance(fn, torch.autograd.function.BackwardCFunction):
        names.append("saved_tensors")
    for name in names:
        try:
            value = getattr(fn, name)
        except RuntimeError:  # a field freed or not saved
            continue
        values.extend(value if isinstance(value, (list, tuple)) else (value,))
    return [t for t in values if isinstance(t, torch.Tensor)]


NO_SAVES = frozenset(f"aten.{name}" for name in (
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Scalar", "div_.Scalar", "neg_.default",
    "copy_.default", "zero_.default", "fill_.Scalar", "fill_.Tensor", "masked_fill_.Scalar", "masked_fill_.Tensor"))
"""In-place ops whose backward reads neither their input nor their result (a residual ``m += a``)."""


def behind_copy_slices(fn: Any, op: str) -> bool:
    """Whether autograd node ``fn`` regenerates a view written in place by ``op`` (its input is a
    ``CopySlices``, which wraps the op's backward and does not show what it saved) and ``op``'s
    backward may read its result (not one of :data:`NO_SAVES`)."""
    return op not in NO_SAVES and any(f is not None and type(f).__name__ == "CopySlices" for f, _ in fn.next_functions)
