"""Nodes and call regions that share one autocast parameter cast: kept, not recomputed.

Under autocast the step casts a parameter that requires grad once and keeps the cast in autocast's
cache, so every later use of the parameter in the forward reads that one cast: a module that applies
a weight twice (LongT5's key and value projections, applied to the hidden states and to the global
inputs; a layer calling ``F.linear(x, self.w)`` on two inputs), and two modules sharing a tied weight.
Backward sums the uses' gradients in the cast's dtype (bfloat16) and casts the sum once. A recomputed
region runs without that cache (:class:`autoremat.runtime.recompute_state.UncachedAutocast`: the
region's casts must not outlive it, and its replay must dispatch what its forward did), so it casts
the parameter itself, and backward sums two casts' gradients in float32: the parameter's gradient is
not bit for bit the unpatched step's (measured, CPU, bf16: Hugging Face LongT5's key and value weights
of every recomputed layer; a leaf module applying one weight twice and a weight tied between two
linear modules, captured at module level and by fx, in every plan recomputing them), and a region
keeping ops (selective saves) counted its ops past the captured step's and raised at its first call
("dispatched aten.view.default as its op 103, where the captured step ran aten.mm.default").

So capture refuses them up front. :class:`CastReads` watches the recorded forward's ops: each
``_to_copy`` of a parameter that requires grad (autocast's cast; under autocast with its cache only)
and every op reading the cast's storage but for views of it, each attributed to the node it ran in
(the op's own node, or the module call or fx node running it). A cast read more than once pins every
node that made or read it (``recomputable=False``, ``graph.meta["pinned_by_shared_cast"]``: node ->
parameter) and every call region holding one of those ops when blocks are captured op by op
(``meta["pinned_regions"]``), logged once; but for the calls of a module run more than once per step:
they run with the step's cache (:func:`autoremat.runtime.recompute_state.shared_casts`), so they read
the one cast as the unpatched step does (LongT5's two calls of its key projection; ALBERT's shared
layer). Decided: ops outside any node (glue between module calls) count as reads but pin nothing
(glue is never recomputed). The ops cannot tell an autocast cache hit from a model that casts a
parameter itself and reuses the result (which a region recomputes exactly); such a model loses those
nodes too (conservative)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..call_names import is_per_call
from .kept_said import say_kept

__all__ = ["CastReads", "SharedCasts", "autocast_caches", "cached_autocast_devices"]

_CAST = torch.ops.aten._to_copy.default


def cached_autocast_devices() -> list[str]:
    """The devices (of CPU and CUDA) whose autocast is on with its cache of parameter casts (the
    runtime's recomputations run without that cache: :class:`autoremat.runtime.recompute_state.UncachedAutocast`)."""
    if not torch.is_autocast_cache_enabled():
        return []
    return [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


def autocast_caches() -> bool:
    """Whether autocast is on (CPU or CUDA) with its cache of parameter casts."""
    return bool(cached_autocast_devices())


@dataclass
class SharedCasts:
    """What sharing casts pins: call regions and nodes, each -> a parameter whose cast it shares."""

    regions: dict[str, str] = field(default_factory=dict)
    nodes: dict[int, str] = field(default_factory=dict)


class CastReads:
    """The recorded forward's autocast parameter casts and the nodes reading each (module docstring).
    ``params``: the model's named parameters; :meth:`note` sees each op of the forward."""

    def __init__(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.on = autocast_caches()
        self._param_of = {p.untyped_storage()._cdata: name for name, p in params} if self.on else {}
        self._casts: dict[int, tuple[str, list[int | None]]] = {}  # cast storage -> (parameter, [maker, readers])
        # a weak reference to each cast's storage: its address (the key) is not handed to another storage
        # while this watches (a cast the model makes itself is freed after its use; a later tensor at its
        # address read as the cast pinned 1-3 of a bf16 Mamba's 3 layers, run to run); its bytes are freed
        self._watched: list[StorageWeakRef] = []
        self._settled: SharedCasts | None = None

    def note(self, func: Any, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], who: int | None) -> None:
        """An op of the forward (its tensor arguments and results) that ran in node ``who``."""
        if not self._param_of:
            return
        keys = {t.untyped_storage()._cdata for t in ins}
        if func is _CAST and len(ins) == 1 and ins[0].requires_grad and ins[0].is_leaf and outs:
            param = self._param_of.get(next(iter(keys)))
            if param is not None:
                storage = outs[0].untyped_storage()
                self._casts[storage._cdata] = (param, [who])
                self._watched.append(StorageWeakRef(storage))
                return
        made = {t.untyped_storage()._cdata for t in outs}
        for k in keys:
            if k in self._casts and k not in made:  # a view of the cast is not a use of it
                self._casts[k][1].append(who)

    def settle(self, nodes: Sequence[Any]) -> SharedCasts:
        """The call regions and nodes to keep, once the step's scopes are named (logged once)."""
        if self._settled is not None:
            return self._settled
        out = SharedCasts()
        for param, whos in self._casts.values():
            if len(whos) < 3:  # the maker and fewer than two readers
                continue
            for w in whos:
                r = None if w is None else nodes[w]
                if r is None or r.kind == "glue":
                    continue
                if r.scope and all(is_per_call(s) for s in r.scope):
                    continue  # one call of a module run several times keeps the step's casts
                if r.recomputable:  # a module call or an fx node
                    out.nodes.setdefault(w, param)
                for region in r.scope:  # an op of a block captured op by op
                    if not is_per_call(region):
                        out.regions.setdefault(region, param)
        self._settled = out
        _log(out, nodes)
        return out


def _log(out: SharedCasts, nodes: Sequence[Any]) -> None:
    if not out.regions and not out.nodes:
        return
    names = [*out.regions, *(nodes[v].name for v in out.nodes)]
    say_kept("autoremat: %d node(s) or call region(s) share an autocast cast of a parameter (%s, in %s): "
             "recomputed, they would cast it again and sum its gradient in float32, not bit for bit the unpatched "
             "step's; they are kept (autoremat.capture.shared_casts)", len(names),
             next(iter([*out.regions.values(), *out.nodes.values()])), names[0])
