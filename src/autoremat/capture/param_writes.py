"""Parameters and inputs a forward writes in place, copied on their first write so that autoremat's
own runs of the model leave them as they were.

``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place in every forward
(``embedding_renorm_`` under ``no_grad``), and other models clip or project weights inside forward.
A capture runs the forward several times (a first call, a recorded step, timed steps) and
:func:`~autoremat.capture.preserved.preserved_state` promises the model as it was; renormalising is not
idempotent in floating point (measured: an embedding renormalised by a capture's runs and then by the
user's first step differed from one renormalised once, so the patched model's first outputs were not
the unpatched model's). Copying every parameter beforehand would take a model's size of memory, so a
parameter is copied the moment it is about to be written: :class:`CopyOnWrite`, a dispatch mode run
around a capture's first forward (the module-level first call, the fx recorded step), looks up each
ATen op's written arguments (its schema's ``Tensor(a!)``) among the parameters' storages and clones a
parameter the first time one is written, for every :func:`preserved_state` block open then (in host
memory, with the dispatch modes off: a measured step's peak does not see the copy). The Lightning
callback's own runs of ``training_step`` and the integrations' measured steps run under it too.
``preserved_state`` puts the copies back when its block ends; a parameter whose version moved with
no copy (a write in a later run only) is left changed, with a warning naming it.

The example batch is watched too: a forward normalising its input in place (``x.sub_(mean)``)
left the batch handed to ``capture`` normalised once per run (measured: 4 times for ``repeats=2,
warmup=1``). The batch is put back when the capture ends; its runs after the first see the batch as
the run before left it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .inplace import written_storages

__all__ = ["CopyOnWrite", "held_copies", "written_first"]

_HELD: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
"""The copies of every open ``preserved_state`` block, innermost last."""


@contextlib.contextmanager
def held_copies() -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """A dict that :class:`CopyOnWrite` fills (``id(tensor) -> (tensor, copy before its first
    write)``) while the block runs."""
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    _HELD.append(held)
    try:
        yield held
    finally:
        _HELD.remove(held)


class CopyOnWrite(TorchDispatchMode):
    """Copies a tensor of ``tensors`` (parameters, the batch) into every open :func:`held_copies`
    dict that lacks it, before the first op that writes its storage in place."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.by_storage = {t.untyped_storage()._cdata: t for t in tensors if t.device.type != "meta"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _HELD and self.by_storage:
            for key in written_storages(func, args, kwargs):
                p = self.by_storage.get(key)
                if p is not None and any(id(p) not in held for held in _HELD):
                    with torch.no_grad(), _disable_current_modes():  # unseen by a measuring mode, off the device
                        copy = p.detach().to("cpu", copy=True)
                    for held in _HELD:
                        held.setdefault(id(p), (p, copy))
        return func(*args, **kwargs)


def written_first(tensors: Iterable[torch.Tensor]) -> Any:
    """:class:`CopyOnWrite` over ``tensors`` where any is on a real device, else a null context."""
    mode = CopyOnWrite(tensors)
    return mode if mode.by_storage else contextlib.nullcontext()
