"""Recompute the regions no gradient reaches: free memory at no cost, for every solver's plan.

A module call whose nodes take no part in backward (an encoder whose output only picks integer
codes: :mod:`autoremat.capture.dead_nodes`) still saves tensors while it runs, held until autograd
frees its graph. Recomputed, it runs its forward saving nothing, and since no gradient reaches it
its replay never runs: the memory goes at no extra time (:mod:`autoremat.cost.unreached`). The
solvers' own models do not all see it: the ``blocks`` chain model takes a block's holdings as
their largest change up to its backward, which is none for storages freed before backward, and a
node-by-node solver prices no time against it either way. So :func:`recompute_unreached` is a
step of :func:`~autoremat.solvers.finalize_plan`: the plan's stored call regions (module level,
:meth:`~autoremat.graph.Graph.recompute_units`) whose every node is such a node, and that hold
something, are recomputed where the simulator says the step peak falls and the extra time does not
rise; the plan is returned as it was otherwise.

Measured (CPU): the Hugging Face ``EncodecModel`` (the seventeenth session's trial configuration),
whose ``blocks`` plan at the least budget recomputed none of the encoder's blocks.
"""

from __future__ import annotations

import dataclasses

from ..cost import simulate
from ..cost.unreached import recomputing, unreached_units
from ..graph import Graph
from ..plan import Plan

__all__ = ["recompute_unreached"]


def recompute_unreached(graph: Graph, plan: Plan) -> Plan:
    """``plan`` with its stored :func:`~autoremat.cost.unreached.unreached_units` recomputed, where
    that lowers the simulated step peak at no more extra time; else ``plan`` itself (module docstring)."""
    units = unreached_units(graph)
    moved = set(plan.offload) | set(plan.offload_saved)
    segments = recomputing(plan.segments, [u for u in units if not moved.intersection(u)])
    if segments == list(plan.segments):
        return plan
    freed = dataclasses.replace(plan, segments=segments)
    before = simulate(graph, plan, check=False, record=False, bandwidth_bytes_per_s=plan.bandwidth_bytes_per_s)
    after = simulate(graph, freed, check=False, record=False, bandwidth_bytes_per_s=plan.bandwidth_bytes_per_s)
    if after.peak_bytes < before.peak_bytes and after.extra_time_s <= before.extra_time_s:
        return freed
    return plan
