"""Parameters whose gradient is sparse (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``).

The cost model allocates each parameter's gradient on its first use in backward, of
``meta["param_bytes"][name]`` bytes, which capture sets to the parameter's own size. A sparse
gradient is not that size: an uncoalesced COO gradient holds one row of values and one index per
lookup of the step (``lookups x dim`` values and ``lookups x 8`` bytes of indices), smaller than
the table for a batch that touches few rows, larger for one that looks rows up many times.
Measured (CPU, a DLRM-like model, four 1000 x 64 tables, 32 samples x 8 lookups per table):
predicted 1.72x the measured step peak with dense gradient sizes.

:class:`SparseGrads` watches every trainable parameter's incoming gradient during capture (a tensor
hook, removed afterwards). A parameter whose gradient is sparse gets, in ``param_bytes``, the bytes
of its indices and values counted from their sizes (the largest seen in one backward; every
capture step has the same batch), and its name goes in ``meta["sparse_grad_params"]``, which
:meth:`Graph.scaled <autoremat.graph.Graph.scaled>` and the scaled capture's fit scale with the
batch (lookups grow with it). From sizes, not storages: the incoming values can be a view of a
larger buffer (an embedding read through ``torch.cat`` gets a slice of the concatenation's
gradient), which accumulation into ``.grad`` copies; and on the meta device ``.grad`` after
accumulation is empty. Decision: the gradient as autograd hands it to the parameter, uncoalesced;
an optimizer that coalesces it does so after the step's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..measure import op_tensors

__all__ = ["SparseGrads", "sparse_bytes"]


def sparse_bytes(grad: torch.Tensor) -> int:
    """Bytes of a sparse tensor's indices and values, from their sizes (what accumulation into ``.grad`` allocates)."""
    return sum(t.numel() * t.element_size() for t in op_tensors(grad))


class SparseGrads:
    """``with SparseGrads(model, param_bytes) as sparse:`` (module docstring); :attr:`names` after."""

    def __init__(self, model: nn.Module, param_bytes: dict[str, int]) -> None:
        self.model = model
        self.param_bytes = param_bytes
        self.seen: dict[str, int] = {}
        self.handles: list[Any] = []

    @property
    def names(self) -> list[str]:
        return sorted(self.seen)

    def __enter__(self) -> "SparseGrads":
        for name, p in self.model.named_parameters():
            if name in self.param_bytes:
                self.handles.append(p.register_hook(self._hook(name)))
        return self

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad.layout is not torch.strided:
                self.seen[name] = max(self.seen.get(name, 0), sparse_bytes(grad))
                self.param_bytes[name] = self.seen[name]  # at once: the recorder's finish reads it
        return hook

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
