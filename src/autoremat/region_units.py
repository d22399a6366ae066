"""A block captured op by op as one offload unit: everything its call saves for backward.

With ``capture(..., blocks="auto")`` (what :class:`~autoremat.AutoRemat`, ``prepare`` and the CLI
use) each repeated block is captured op by op: its call is a *call region*
(:meth:`~autoremat.graph.Graph.call_regions`) and what it keeps for backward is spread over many
small nodes (their saved outputs and ``extra_saved_bytes``). ``Plan.offload_saved`` naming the
**first node of such a region** offloads all of it as one unit (``-1 - v``, as a node's own saved
tensors, :mod:`autoremat.plan_offload`); the runtime runs the block's call inside the same
``saved_tensors_hooks`` scope as a module-level unit (:mod:`autoremat.runtime.offload_saved`).

The unit's **parts** follow the runtime's rule for what a call's scope leaves out (parameters and
buffers, the call's inputs and outputs, views of them): the ``extra_saved_bytes`` of every region
node that takes part in backward, and every storage a region node saves that the region itself
produced and that is not one of its outputs (read after the call, or an output of the model).

Which regions: the outermost call of each block captured op by op (``graph.meta["call_op_start"]``),
its nodes consecutive in the graph (each call of a block run more than once per step,
``"<path>@<k>/<n>"``, is a unit of its own: the runtime scopes the calls ``Plan.offload_calls``
names, :mod:`autoremat.runtime.offload_calls`), not pinned (``meta["pinned_regions"]``: an input written in place, or a key/value cache;
:meth:`~autoremat.graph.Graph.call_regions` leaves those out). Torch-free.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .call_names import plain_path
from .graph import Graph

__all__ = ["RegionUnit", "region_units", "region_unit", "unit_span"]


@dataclass(frozen=True)
class RegionUnit:
    """One block call's saved tensors as an offload unit (see the module docstring)."""

    path: str
    nodes: tuple[int, ...]
    """The region's nodes, in execution order (consecutive ids)."""
    extra: tuple[int, ...]
    """Region nodes whose ``extra_saved_bytes`` are parts of the unit."""
    roots: tuple[int, ...]
    """Output storages (roots) saved by region nodes that are parts of the unit."""
    nbytes: int
    """What one transfer moves: the parts' bytes."""
    first_use: int
    """The region node whose backward first reads a part (the last one in forward that holds one);
    -1 when the unit is empty."""
    output: int = -1
    """The region's last node when its output is the only storage the block hands on (what the
    block's call returns; a plan may offload it as the call's output, ``Plan.offload``), else -1."""

    @property
    def last(self) -> int:
        """The region's last node: the unit's copy out is issued when its forward ends."""
        return self.nodes[-1]


_CACHE: "weakref.WeakKeyDictionary[Graph, dict[int, RegionUnit]]" = weakref.WeakKeyDictionary()


def region_units(graph: Graph) -> dict[int, RegionUnit]:
    """First node -> :class:`RegionUnit` of each block region a plan may offload as a unit
    (``{}`` unless blocks were captured op by op). Computed once per graph."""
    if graph in _CACHE:
        return _CACHE[graph]
    out: dict[int, RegionUnit] = {}
    starts = graph.meta.get("call_op_start") or {}
    if graph.meta.get("mode") == "module" and starts:
        regions = graph.call_regions()
        plain = {plain_path(q) for q in starts}
        for path in starts:
            nodes = regions.get(path)
            p = plain_path(path)  # inside another block's call when a prefix of p ending before a "." is one
            if nodes is None or any(p[:i] in plain for i, c in enumerate(p) if c == "."):
                continue  # a call inside another block's call: the outer call is the unit
            if list(nodes) != list(range(nodes[0], nodes[0] + len(nodes))):
                continue  # called more than once (or interleaved): not one call
            out[nodes[0]] = _unit(graph, path, nodes)
    _CACHE[graph] = out
    return out


def region_unit(graph: Graph, v: int) -> RegionUnit | None:
    """The region unit whose first node is ``v`` (else ``None``)."""
    return region_units(graph).get(v) if graph.meta.get("call_op_start") else None


def _unit(graph: Graph, path: str, nodes: tuple[int, ...]) -> RegionUnit:
    members = set(nodes)
    outputs = {graph.root(v) for v in nodes
               if graph.held_to_loss(v) or any(w not in members for w in graph.succ(v))}
    extra: list[int] = []
    roots: dict[int, None] = {}
    first_use = -1
    for w in nodes:
        d = graph.node(w)
        if not d["requires_grad"]:
            continue
        holds = False
        if d["extra_saved_bytes"] > 0:
            extra.append(w)
            holds = True
        for u in d["saves"]:
            r = graph.root(u)
            if r in members and r not in outputs and graph.node(r)["alloc_bytes"] > 0:
                roots[r] = None
                holds = True
        if holds:
            first_use = w
    nbytes = sum(int(graph.node(w)["extra_saved_bytes"]) for w in extra)
    nbytes += sum(int(graph.node(r)["alloc_bytes"]) for r in roots)
    output = nodes[-1] if outputs == {nodes[-1]} else -1
    return RegionUnit(path, tuple(nodes), tuple(extra), tuple(roots), nbytes, first_use, output)


def unit_span(graph: Graph, u: int) -> tuple[int, int]:
    """Unit ``u`` (a node's output ``v``, or ``-1 - v``: its own saved tensors or its region's) ->
    (the node after whose forward it is copied out, the node whose backward first reads it) for a
    region unit; ``(v, v)`` otherwise."""
    if u < 0:
        ru = region_unit(graph, -1 - u)
        if ru is not None:
            return ru.last, ru.first_use
        return -1 - u, -1 - u
    return u, u
