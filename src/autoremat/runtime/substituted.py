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
  drew other numbers in the replay and advanced the generator twice;
* under ``torch.nn.utils.parametrize.cached()`` (a parametrized weight, ``orthogonal`` say, computed
  once per step), a backward inside the cached block found the weight the forward computed in the
  cache, so the replay skipped the parametrization's ops: a ``RecomputationMismatchError`` (measured,
  CPU: a 4-layer stack of ``orthogonal`` linears, least plan).

:class:`HeldState` takes, when a region's forward starts, the entries of its modules' instance
dicts and parameter and buffer dicts (:func:`state_dicts`; references, no copies: the forward holds
them anyway), the states of its generators and, under ``parametrize.cached()``, the cache's
entries; the recomputation runs with the entries that differ by then put back (and the cache as
the forward found it), and leaves every dict, generator and cache as it found them. The common case, nothing
changed, costs one identity comparison per entry.

Decided: parameters read through ``get_attr`` of an fx trace (not a called module's) are guarded by
:mod:`autoremat.runtime.guard` instead (a changed identity runs the model's own forward); a
container a forward changes in place (``self.seen.append(x)``) is the same object at both times
and is not put back (capture keeps such calls from recomputation: :mod:`autoremat.capture.container_writes`);
entries are compared by identity, so a plain value replaced by an equal one (an ``int`` past the
small-integer cache) is put back too (harmless). Holding the entries has a cost the cost model does
not count: a tensor attribute a forward replaces (``self.last = h``, an activation kept for
inspection) lives until the region's recomputation instead of until that forward replaced it, and so
do the weights ``parametrize.cached()`` held at the forward, where the backward runs after the block."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.utils.parametrize
from torch import nn

__all__ = ["state_dicts", "HeldState", "holds_state"]

_MISSING = object()


def holds_state(dicts: tuple[dict[str, Any], ...], generators: Any) -> bool:
    """Whether a region with these ``dicts`` and ``generators`` has a :class:`HeldState` to keep (or
    ``parametrize.cached()`` is on)."""
    return bool(dicts) or generators is not None or bool(torch.nn.utils.parametrize._cache_enabled)


def _cache_now(copy: bool = True) -> tuple[int, dict]:
    """``parametrize.cached()``'s state: how many blocks are open, and its entries (a copy)."""
    cache = torch.nn.utils.parametrize._cache
    return torch.nn.utils.parametrize._cache_enabled, dict(cache) if copy else cache


def _set_cache(enabled: int, entries: dict) -> None:
    torch.nn.utils.parametrize._cache_enabled = enabled
    torch.nn.utils.parametrize._cache = entries


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

    __slots__ = ("dicts", "held", "found", "generators", "advanced", "cache", "outer")

    def __init__(self, dicts: tuple[dict[str, Any], ...],
                 generators: list[tuple[torch.Generator, torch.Tensor]] | None = None) -> None:
        self.dicts = dicts
        self.held = [dict(d) for d in dicts]
        self.found: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.generators = generators
        self.advanced: list[torch.Tensor] = []
        self.cache = _cache_now() if torch.nn.utils.parametrize._cache_enabled else None
        self.outer: tuple[int, dict] | None = None

    def __enter__(self) -> "HeldState":
        if self.cache is not None or torch.nn.utils.parametrize._cache_enabled:  # parametrize.cached(): as at the forward
            self.outer = _cache_now(copy=False)
            enabled, entries = self.cache or (0, {})
            _set_cache(enabled, dict(entries))
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
        if self.outer is not None:
            _set_cache(*self.outer)
            self.outer = None
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
