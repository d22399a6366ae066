"""What an autograd node keeps for its backward, read from the node itself (the module-level
capture's saves of an op of a block, :meth:`autoremat.capture.module._ModuleRecorder._read_saves`).

An in-place op on a view (``nn.ReLU(inplace=True)`` after a linear layer whose output was reshaped:
Swin v2's continuous position-bias MLP) gives the view a regenerated view node
(``AsStridedBackward0``) whose input is a ``CopySlices`` wrapping the op's own backward, which
Python cannot read: :func:`behind_copy_slices` tells, and the capture then takes the op to save its
result (ReLU's backward reads it), unless its backward reads neither its input nor its result
(:data:`NO_SAVES`: ``add_``, ``mul_`` by a scalar, ...; a residual ``m += a`` on a linear layer's output,
Falcon's parallel residual), or reads its other argument only (:data:`OTHER_SAVES`, :func:`hidden_saves`:
``mul_`` and ``div_`` by a tensor keep that tensor, and a copy of the view's old values, made before the
write, where that tensor needs a gradient). For another op that saves nothing the write's storage is held
a little longer than needed: high, never low. Without it the storage was freed at its last reader's
backward, before the ReLU's, and Swin v2's unpatched step was predicted 0.94x its measured peak; taking
``mul_`` by a mask to save its result held an einsum's whole output to backward in the Hugging Face
Funnel's relative-position attention (``positional_attn *= cls_mask`` on a slice of it): its unpatched
step was predicted 1.11x its measured peak."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["NO_SAVES", "OTHER_SAVES", "behind_copy_slices", "handed", "hidden_saves", "saved_by"]


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


OTHER_SAVES = frozenset({"aten.mul_.Tensor", "aten.div_.Tensor"})
"""In-place ops whose backward reads their other argument, never their result (checked against what
autograd packs: ``tests/capture/test_inplace_view_saves.py``)."""


def handed(func: Any, args: tuple) -> tuple[int, int, bool] | None:
    """What :func:`hidden_saves` needs of an op of :data:`OTHER_SAVES`: its other argument's storage key
    and bytes, and whether it needs a gradient; ``None`` for other ops."""
    other = args[1] if len(args) > 1 and str(func) in OTHER_SAVES else None
    if not isinstance(other, torch.Tensor):
        return None
    st = other.untyped_storage()
    return st._cdata, st.nbytes(), other.requires_grad


def hidden_saves(op: str, other: tuple[int, int, bool] | None, out_bytes: int,
                 v: int) -> list[tuple[Hashable, int]]:
    """``(storage key, bytes)`` of what the hidden backward of in-place op ``op`` (node ``v``, writing a view of
    ``out_bytes``) keeps, where :func:`handed` knew its ``other`` argument: that argument, and a copy of the
    view's old values (a storage of no node) where it needs a gradient; else ``[]``."""
    if other is None or op not in OTHER_SAVES:
        return []
    key, nbytes, needs_grad = other
    return [(key, nbytes)] + ([(("copy", v), out_bytes)] if needs_grad else [])
