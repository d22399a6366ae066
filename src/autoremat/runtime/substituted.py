"""The module state a recomputed region's forward ran with, put back for its recomputation.

A region is recomputed in backward, when the modules may hold other state than when its forward
ran, and a replay reading that state computed other values than the forward did, silently:

* ``torch.func.functional_call(model, params, args)`` (meta-learning, stateless training loops)
  swaps other tensors into the modules' ``_parameters`` and ``_buffers`` for the call only, so the
  replay read the model's own (measured, CPU: the least plans of the zoo's ResNet-50 and of Hugging
  Face GPT-2 under ``functional_call`` with scaled parameters, 128 of 161 and 44 of 52 gradients
  not equal to the unpatched model's);
* a forward that updates plain attributes (a call counter ``self.calls += 1`` that later steps
  branch on, a tensor kept for inspection ``self.attn = attn``) ran that update again in the
  replay: the counter advanced twice per step and the model's next steps differed (measured, CPU:
  a 4-layer stack whose layers halve a branch from their third call on, least plan: gradients
  not equal from the second step on, counters at 2x);
* a module drawing from its own ``torch.Generator`` (``torch.rand(..., generator=self.gen)``)
  drew other numbers in the replay and advanced the generator twice.

:class:`HeldState` takes, when a region's forward starts, the entries of its modules' instance
dicts and parameter and buffer dicts (:func:`state_dicts`; references, no copies: the forward holds
them anyway) and the states of its generators; the recomputation runs with the entries that differ
by then put back, and leaves every dict and generator as it found it. The common case, nothing
changed, costs one identity comparison per entry.

Decided: parameters read through ``get_attr`` of an fx trace (not a called module's) are guarded by
:mod:`autoremat.runtime.guard` instead (a changed identity runs the model's own forward); a
container a forward changes in place (``self.seen.append(x)``) is the same object at both times
and is not put back (capture keeps such calls from recomputation: :mod:`autoremat.capture.container_writes`);
entries are compared by identity, so a plain value replaced by an equal one (an ``int`` past the
small-integer cache) is put back too (harmless). Holding the entries has a cost the cost model does
not count: a tensor attribute a forward replaces (``self.last = h``, an activation kept for
inspection) lives until the region's recomputation instead of until that forward replaced it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["state_dicts", "HeldState"]

_MISSING = object()


def state_dicts(modules: Iterable[nn.Module]) -> tuple[dict[str, Any], ...]:
    """The instance dicts and the non-empty parameter and buffer dicts of ``modules`` and their
    submodules, each once."""
    seen: set[int] = set()
    out: list[dict[str, Any]] = []
    for top in modules:
        for m in top.modules():
            for d in (m.__dict__, m._parameters, m._buffers):
                if d and id(d) not in seen:
                    seen.add(id(d))
                    out.append(d)
    return tuple(out)


class HeldState:
    """What ``dicts`` (:func:`state_dicts`) held when made (a region's forward start); entered
    around the region's recomputation, puts back the entries that differ now, and sets each of
    ``generators`` (a list of ``(generator, state at the forward)``, which the caller may fill once
    the forward has run) to its forward state; on exit leaves all as it found them."""

    __slots__ = ("dicts", "held", "found", "generators", "advanced")

    def __init__(self, dicts: tuple[dict[str, Any], ...],
                 generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> None:
        self.dicts = dicts
        self.held = [dict(d) for d in dicts]
        self.found: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.generators = generators
        self.advanced: list[torch.Tensor] = []

    def __enter__(self) -> "HeldState":
        if self.generators:
            self.advanced = [g.get_state() for g, _ in self.generators]
            for g, state in self.generators:
                g.set_state(state)
        for d, h in zip(self.dicts, self.held):
            if len(d) == len(h) and all(d.get(k, _MISSING) is v for k, v in h.items()):
                continue
            now = {k: d.get(k, _MISSING) for k in {*d, *h} if d.get(k, _MISSING) is not h.get(k, _MISSING)}
            _put(d, {k: h.get(k, _MISSING) for k in now})
            self.found.append((d, now))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (g, _), state in zip(self.generators or (), self.advanced):
            g.set_state(state)
        self.advanced = []
        for d, now in reversed(self.found):
            _put(d, now)
        self.found = []


def _put(d: dict[str, Any], entries: dict[str, Any]) -> None:
    for k, v in entries.items():
        if v is _MISSING:
            d.pop(k, None)
        else:
            d[k] = v
