"""The sums of two gradients of one tensor that the autograd engine makes in backward, as a dispatch
mode sees them.

Any ``TorchDispatchMode`` changes one thing autograd does: while a mode is active,
``at::isTensorSubclassLike`` is true for every tensor, so the engine adds a second gradient reaching
one input out of place (``old + new`` in a third buffer, dispatched as ``aten.add``). Without a mode
it adds in place (``add_``) into a first gradient it owns that is dense (contiguous, or permuted:
channels_last) and no view of another buffer (a gradient a reshape or transpose handed on shares its
storage with the buffer it views): ``can_accumulate_inplace`` of PyTorch's ``input_buffer.cpp``.
:func:`engine_sum` tells such an ``add`` from the model's own and says which the plain engine would
have made; :class:`GradSums` keeps what the sums showed: the gradients whose first part was a view,
summed out of place by the plain engine too (capture's ``first_grad_view``, the cost model's rule,
:mod:`autoremat.cost.grad_handoff`). :class:`~autoremat.measure.LiveStorageCounter` uses both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._fsdp import local_tensor

__all__ = ["engine_sum", "GradSums", "dense"]

_ADD = torch.ops.aten.add.Tensor


def engine_sum(func: Any, args: tuple, kwargs: Mapping[str, Any] | None, made: tuple[str, int] | None,
               seen: Mapping[int, int], born: Mapping[int, tuple[str, int]]) -> bool | None:
    """Whether the plain engine adds this sum in place; None where the op is no sum of two gradients the
    engine made: an ``add`` in backward (``made``: the autograd node running) of two strided tensors of
    one shape and dtype, the first a counted storage (``seen``) that the running node did not make
    (``born``: storage key -> the node that made it)."""
    if made is None or func is not _ADD or kwargs or len(args) != 2:
        return None
    a, b = args
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
            or a.dtype != b.dtype or a.layout != torch.strided or b.layout != torch.strided:
        return None
    ka = local_tensor(a).untyped_storage()._cdata
    if ka not in seen or born.get(ka) == made:
        return None
    return a._base is None and dense(a)


class GradSums:
    """The engine's sums a counter saw: which gradients had a first part that was a view."""

    def __init__(self) -> None:
        self._origin: dict[int, int] = {}
        """Storage key of a sum whose first gradient was a view or not dense -> its first sum's index
        in :attr:`view_sums`."""
        self.view_sums: list[int] = []
        """The bytes of each sum the plain engine makes out of place because the first part was such a view."""
        self.on_sum: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        """Called as ``on_sum(a, b, out)`` for each sum (capture uses it: a node whose own gradient is a
        part passed it through)."""

    def note(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, in_place: bool, nbytes: int) -> None:
        """The engine summed ``a`` (the first) and ``b`` into ``out`` (``nbytes``); ``in_place``: as
        :func:`engine_sum` says the plain engine would."""
        key = local_tensor(out).untyped_storage()._cdata
        if not in_place:
            self._origin[key] = len(self.view_sums)
            self.view_sums.append(nbytes)
        else:
            first = self._origin.get(local_tensor(a).untyped_storage()._cdata)
            if first is not None:  # a later sum of a gradient whose first part was a view
                self._origin[key] = first
        if self.on_sum is not None:
            self.on_sum(a, b, out)

    def origin(self, grad: torch.Tensor) -> int | None:
        """Where ``grad``, a gradient summed while the counter ran, had a first part the engine could
        not add into, the index in :attr:`view_sums` of its first sum; else None."""
        return self._origin.get(local_tensor(grad).untyped_storage()._cdata)

    def release(self, key: int) -> None:
        """The storage ``key`` is gone (its key may name another one from now)."""
        self._origin.pop(key, None)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its elements without gaps or overlaps in some order of its dimensions
    (ATen's ``is_non_overlapping_and_dense``: a transposed or permuted tensor is)."""
    if t.layout != torch.strided:
        return False
    if t.is_contiguous():
        return True
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True
