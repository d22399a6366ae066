"""Failure atomicity for the integrations (issue 29): a call that fails leaves the model as it was.

``capture``, ``apply`` and ``restore`` are atomic on their own (parameters, buffers,
``requires_grad``, ``.grad``, hooks, ``forward``, ``training`` flags and the RNG are put back
when they raise). What an integration does *around* them is not: Accelerate's
:func:`~autoremat.integrations.accelerate.prepare` moves the model to the accelerator's device
before it captures, and the Lightning callback sets up the training dataloader (starting an
iterator draws a seed from the global RNG) and may change the batch size. :class:`Rollback`
records all of that before the integration starts and :meth:`Rollback.put_back` restores it
when the integration raises:

* **placement**: every module's parameter and buffer entries (the same objects), each
  parameter's data and ``.grad`` (object and data), so a ``model.to(device)`` that moved
  parameters in place (the same ``nn.Parameter`` objects, new storage) or replaced buffers is
  undone exactly, values included;
* **RNG**: the CPU generator and the generators of the CUDA devices given.

Nothing here imports a training framework.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Rollback"]


class Rollback:
    """What an integration may change on ``model`` and the RNG, as it is now (see the module
    docstring); ``devices``: the devices whose RNG to save besides the CPU's (CUDA ones count)."""

    def __init__(self, model: nn.Module, devices: Iterable[torch.device | str] = ()) -> None:
        modules = list(model.modules())
        self._entries = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
        seen: set[int] = set()
        self._params: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for _m, params, _b in self._entries:
            for p in params.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                grad = p.grad
                self._params.append((p, p.data, grad, None if grad is None else grad.data))
        self._cuda = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
        self._rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(i) for i in self._cuda]

    def put_back(self) -> None:
        """Restore placement and RNG state (idempotent)."""
        for m, params, buffers in self._entries:
            _refill(m._parameters, params)
            _refill(m._buffers, buffers)
        for p, data, grad, grad_data in self._params:
            if not _same_storage(p.data, data):
                p.data = data
            if grad is not None and grad_data is not None and not _same_storage(grad.data, grad_data):
                grad.data = grad_data
            if p.grad is not grad:
                p.grad = grad
        torch.set_rng_state(self._rng)
        for i, state in zip(self._cuda, self._cuda_rng):
            torch.cuda.set_rng_state(state, i)


def _refill(table: dict[str, Any], saved: dict[str, Any]) -> None:
    if table.keys() != saved.keys() or any(table[k] is not v for k, v in saved.items()):
        table.clear()
        table.update(saved)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device.type == "meta":
        return False
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
            a.storage_offset() == b.storage_offset() and a.stride() == b.stride()
    except RuntimeError:  # FSDP1's flat-parameter views may have no readable storage ("invalid python
        # storage") while sharded: the engine owns them; placing them back would break its views
        return True
