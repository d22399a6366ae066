"""A loss that reads real tensors beside a meta capture's output (a diffusion step's noise target).

The meta capture of a step that does not fit (:mod:`autoremat.capture.scaled`) runs the model on meta
tensors and hands the meta output to the user's ``loss_fn``. A loss that closes over a real tensor of
the batch (``lambda out: F.mse_loss(out.sample, noise)``, the usual diffusion step) then mixed devices
and failed ("Tensor on device cpu is not on the expected device meta"), so the bytes came from a linear
fit of real captures at smaller batches, at which the closed-over target no longer fits the output.
:func:`loss_on` runs such a loss with each real tensor that meets a meta one replaced by a meta tensor
of its shape, strides and dtype. The copy counts as what the real tensor is, resident (a batch tensor
exists before the step): its storage is added to the recorder's resident keys, made where the
live-storage counter does not see it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["loss_on"]


def _is_real(t: Any) -> bool:
    # a 0-dim CPU tensor meets tensors of any device; one that requires grad is left to fail as before
    return isinstance(t, torch.Tensor) and not t.is_meta and t.dim() > 0 and not t.requires_grad


class _MetaTargets(TorchFunctionMode):
    def __init__(self, resident: set[int]) -> None:
        super().__init__()
        self.resident = resident
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (real, meta): ids stay valid

    def _meta(self, t: Any) -> Any:
        if not _is_real(t):
            return t
        if id(t) not in self.copies:
            with _disable_current_modes():  # the counter does not see it: the real tensor is resident
                m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            self.resident.add(m.untyped_storage()._cdata)
            self.copies[id(t)] = (t, m)
        return self.copies[id(t)][1]

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def, override]
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat) and any(_is_real(t) for t in flat):
            args, kwargs = tree_map(self._meta, (args, kwargs))
        return func(*args, **kwargs)


def loss_on(loss_fn: Callable[[Any], torch.Tensor], output: Any, resident: set[int]) -> torch.Tensor:
    """``loss_fn(output)``; on a meta ``output``, real tensors it meets become meta (module docstring)."""
    if not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(output)[0]):
        return loss_fn(output)
    with _MetaTargets(resident) as mode:
        loss = loss_fn(output)
    if isinstance(loss, torch.Tensor):  # else run_loss says what it must be
        loss._autoremat_meta_targets = mode.copies  # the copies (resident keys) live as long as the loss
    return loss
