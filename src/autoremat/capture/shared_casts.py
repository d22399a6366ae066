"""Call regions that read one autocast parameter cast more than once: kept, not recomputed.

Under autocast the step casts a parameter that requires grad once and keeps the cast in autocast's
cache, so a module that uses the parameter twice (LongT5's key and value projections, applied to the
hidden states and to the global inputs) reads one cast twice; backward sums the two uses' gradients in
the cast's dtype (bfloat16) and casts the sum once. A recomputed region runs without that cache
(:class:`autoremat.runtime.recompute_state.UncachedAutocast`: the region's casts must not outlive it,
and its replay must dispatch what its forward did), so it casts the parameter at each use, and
backward sums the two casts' gradients in float32: the parameter's gradient is not bit for bit the
unpatched step's (measured, CPU, Hugging Face LongT5 under bf16: the key and value weights of every
recomputed layer), and a region keeping ops (selective saves) counted its ops past the captured step's
and raised at its first call ("dispatched aten.view.default as its op 103, where the captured step ran
aten.mm.default").

So such regions are refused up front: :func:`shared_cast_regions` finds, among the ops of blocks
captured op by op, each cast of a parameter (``_to_copy`` reading one) that two or more ops read, and
pins every call region holding the cast or one of its readers (``meta["pinned_regions"]``, logged
once), but for the calls of a module run more than once per step: they run with the step's cache
(:func:`autoremat.runtime.recompute_state.shared_casts`), so they read the one cast as the unpatched
step does (LongT5's two calls of its key projection; ALBERT's shared layer). The graph cannot tell an
autocast cache hit from a model that casts a parameter itself and reuses the result (which a region
recomputes exactly); such a model loses those regions too. Module calls captured as single nodes are
not examined (their ops are not in the graph)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..call_names import is_per_call

__all__ = ["shared_cast_regions"]

logger = logging.getLogger("autoremat.capture")


def shared_cast_regions(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], ops: Sequence[int]) -> dict[str, str]:
    """Call region -> a parameter whose autocast cast its ops read more than once (module docstring);
    ``ops``: the op nodes of blocks captured op by op (their ``scope`` named per call). Empty unless
    autocast (with its cache) is on."""
    if not torch.is_autocast_cache_enabled() or not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")):
        return {}
    out: dict[str, str] = {}
    for v in ops:
        r = nodes[v]
        if not r.params or not r.name.endswith("_to_copy.default"):
            continue
        readers = [w for w in succs.get(v, ()) if nodes[w].alias_of is None]
        if len(readers) < 2:
            continue
        for w in (v, *readers):
            for region in nodes[w].scope:
                if not is_per_call(region):  # one call of a module run several times keeps the step's casts
                    out.setdefault(region, r.params[0])
    if out:
        region, param = next(iter(out.items()))
        said = (len(out), param, region)
        if said not in _SAID:  # once, though capture_within captures the model more than once
            _SAID.add(said)
            logger.warning("autoremat: %d call region(s) read an autocast cast of a parameter more than once (%s in "
                           "%s): recomputed, they would cast it at each use and sum its gradient in float32, not bit "
                           "for bit the unpatched step's; they are kept (autoremat.capture.shared_casts)", *said)
    return out


_SAID: set[tuple[int, str, str]] = set()
