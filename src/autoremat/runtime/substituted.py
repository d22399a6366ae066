"""The parameters and buffers a recomputed region's forward ran with, put back for its recomputation.

``torch.func.functional_call(model, params, args)`` (meta-learning, stateless training loops) swaps
other tensors into the modules' ``_parameters`` and ``_buffers`` for the duration of the call and
swaps the model's own back when it returns: before backward, so before any region is recomputed.
A region replaying its modules then read the model's own tensors, not those its forward ran with,
and trained with wrong gradients, silently (measured, CPU: the least plans of the zoo's ResNet-50
and of Hugging Face GPT-2 under ``functional_call`` with scaled parameters, 128 of 161 and 44 of 52
gradients not equal to the unpatched model's).

:class:`HeldState` takes, when a region's forward starts, the tensors its modules' parameter and
buffer dicts hold (references only: the region's forward holds them anyway); its recomputation runs
with them put back where the dicts now hold others, and the dicts are left as they were found
afterwards. The common case, nothing swapped, costs one identity comparison per tensor.
Decided: parameters read through ``get_attr`` of an fx trace (not a called module's) are guarded
by :mod:`autoremat.runtime.guard` instead (a changed identity runs the model's own forward), and a
module's tensors a region reads without holding the module (a tied weight read through another
module) are put back with that module only when that module is one of the region's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["state_dicts", "HeldState"]


def state_dicts(modules: Iterable[nn.Module]) -> tuple[dict[str, Any], ...]:
    """The non-empty parameter and buffer dicts of ``modules`` and their submodules, each once."""
    seen: set[int] = set()
    out: list[dict[str, Any]] = []
    for top in modules:
        for m in top.modules():
            for d in (m._parameters, m._buffers):
                if d and id(d) not in seen:
                    seen.add(id(d))
                    out.append(d)
    return tuple(out)


class HeldState:
    """What ``dicts`` (:func:`state_dicts`) held when made (a region's forward start); entered
    around the region's recomputation, puts that back where the dicts hold other tensors now, and
    sets each of ``generators`` (a list of ``(generator, state at the forward)``, which the caller
    may fill once the forward has run) to its forward state, leaving it as found afterwards."""

    __slots__ = ("dicts", "held", "found", "generators", "advanced")

    def __init__(self, dicts: tuple[dict[str, Any], ...],
                 generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> None:
        self.dicts = dicts
        self.held = [dict(d) for d in dicts]
        self.found: list[dict[str, Any]] | None = None
        self.generators = generators
        self.advanced: list[torch.Tensor] = []

    def _changed(self) -> bool:
        for d, h in zip(self.dicts, self.held):
            if len(d) != len(h) or any(d.get(k) is not v for k, v in h.items()):
                return True
        return False

    def __enter__(self) -> "HeldState":
        if self.generators:
            self.advanced = [g.get_state() for g, _ in self.generators]
            for g, state in self.generators:
                g.set_state(state)
        if self.dicts and self._changed():
            self.found = [dict(d) for d in self.dicts]
            for d, h in zip(self.dicts, self.held):
                d.clear()
                d.update(h)
        return self

    def __exit__(self, *exc: Any) -> None:
        for (g, _), state in zip(self.generators or (), self.advanced):
            g.set_state(state)
        self.advanced = []
        if self.found is not None:
            for d, f in zip(self.dicts, self.found):
                d.clear()
                d.update(f)
            self.found = None

