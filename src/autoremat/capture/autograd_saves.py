"""What an autograd node keeps for its backward, read from the node itself (the module-level
capture's saves of an op of a block, :meth:`autoremat.capture.module._ModuleRecorder._read_saves`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["saved_by"]


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
