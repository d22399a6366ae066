"""The per-rank memory of a step under FSDP, as a graph the one simulator runs.

Under sharding a rank holds, before a step, its shard of the parameters, of the gradients and
of the optimizer state (each about ``1 / world_size`` of the whole, :func:`autoremat.resident.resident_bytes`
with ``shard_over``; a ``DTensor`` counts with its local shard), plus buffers and its batch.
During the step it holds what the unsharded model would (activations, their gradients,
workspace: the batch per rank is the same) **plus what FSDP has in flight**. This module does
not add memory rules to the simulator: :func:`per_rank_graph` returns a copy of the captured
graph in which FSDP's allocations are the nodes' own workspace, and
:func:`autoremat.simulate` predicts the per-rank step peak from it as from any graph:

* **parameter gradients**: a unit's full-size gradients live while its backward runs, its shard
  (``1 / world_size``, padded) from the end of its backward to the end of the step;
* **forward** of a node inside unit ``u``: the unsharded parameters of ``u`` and of the units
  around it (FSDP2 reshards a unit after its forward) and, when the model's own parameters are
  sharded, those too (FSDP2 keeps the root unsharded through the step); with more than one rank
  also ``u``'s all-gather output, which FSDP2 keeps until the next unit's parameters are copied
  out (its implicit forward prefetch);
* **backward** of a node inside ``u``: the same unsharded parameters, the next unit's (in
  backward order) prefetched parameters, the reduce-scatter input of the unit whose backward
  ended before (FSDP2 keeps it until the next reduce-scatter) and ``u``'s full-size gradients
  accumulated so far (reduce-scattered into the shard when ``u``'s backward ends);
* **recomputation**: with :mod:`autoremat.runtime.sharding` a recomputed segment runs inside its
  unit during that unit's backward, so a node of a recomputed segment carries the backward's
  in-flight bytes (its forward then over-counts by the difference);
* nodes at the model's own level between units hold the neighbouring units' buffers.

What it does not model: FSDP2 mixed precision (``param_dtype`` casts), ``reshard_after_forward``
other than ``True`` for units and ``False`` for the root, explicit prefetch settings, CPU
offload, and FSDP1's different buffer handling (the model is FSDP2's; FSDP1 runs are reported
against it). Measured on the tested models: ``tests/integrations/test_fsdp_memory.py`` and
``benchmarks/results/cpu/fsdp/``.

Solvers import no torch, and neither does this module: the :class:`ShardingSpec` (plain
numbers) is made from a model by :func:`autoremat.runtime.sharding.sharding_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .graph import Graph
from .plan import Plan

__all__ = ["ShardingSpec", "per_rank_graph", "shard_bytes"]


def shard_bytes(nbytes: int, world_size: int) -> int:
    """Bytes of one rank's shard of ``nbytes`` (rounded up)."""
    return int(math.ceil(nbytes / max(1, world_size)))


@dataclass(frozen=True)
class ShardingSpec:
    """How a model is sharded, in the graph's terms (JSON-able: it travels with a plan).

    ``units``: the canonical paths of the FSDP units, in forward order; ``unit_bytes``: the
    unsharded (padded) bytes of the parameters each unit owns (not those of units inside it),
    ``""`` for the model's own parameters; ``node_units``: per graph node, the units it runs
    inside, outermost first; ``root_sharded``: the model's own parameters are sharded (FSDP2's
    ``fully_shard(model)``, an FSDP1 wrapper of it); ``fsdp_version``: 1 or 2."""

    world_size: int
    units: tuple[str, ...]
    unit_bytes: Mapping[str, int]
    node_units: tuple[tuple[str, ...], ...]
    root_sharded: bool = True
    fsdp_version: int = 2
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["units"], d["node_units"] = list(self.units), [list(u) for u in self.node_units]
        d["unit_bytes"], d["extra"] = dict(self.unit_bytes), dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ShardingSpec":
        return cls(world_size=int(d["world_size"]), units=tuple(d["units"]),
                   unit_bytes={str(k): int(v) for k, v in d["unit_bytes"].items()},
                   node_units=tuple(tuple(u) for u in d["node_units"]), root_sharded=bool(d["root_sharded"]),
                   fsdp_version=int(d.get("fsdp_version", 2)), extra=dict(d.get("extra", {})))


def per_rank_graph(graph: Graph, spec: ShardingSpec, plan: Plan | None = None) -> Graph:
    """A copy of ``graph`` whose simulation is the per-rank step under ``spec`` (module
    docstring); with ``plan``, its recomputed nodes carry the backward's in-flight bytes."""
    if len(spec.node_units) != len(graph):
        raise ValueError(f"spec.node_units has {len(spec.node_units)} entries for a graph of {len(graph)} nodes; "
                         "make the spec from this graph's model (autoremat.runtime.sharding.sharding_spec)")
    g = graph.copy()
    w = spec.world_size
    ub = spec.unit_bytes
    root = ub.get("", 0) if spec.root_sharded else 0
    spans: dict[str, tuple[int, int]] = {}
    for v, chain in enumerate(spec.node_units):
        for u in chain:
            spans[u] = (spans.get(u, (v, v))[0], v)
    last_unit = max(spans, key=lambda u: spans[u][1]) if spans else ""
    full = dict(g.meta.get("param_bytes", {}))
    grads = _grad_bytes_so_far(g, spec, full)
    _shard_gradients(g, spec, full, spans)
    recomputed = {v for seg in (plan.recompute_segments if plan is not None else ()) for v in seg.nodes}
    for v in g.nodes:
        chain = spec.node_units[v]
        gathered = root + sum(ub.get(u, 0) for u in chain)
        before, after = _neighbours(spans, chain, v)
        # FSDP2 keeps a unit's all-gather output (flat, as large as its parameters) until the next
        # unit's copy-out in forward; with one rank it copies the shards instead of all-gathering
        fwd = gathered + (ub.get(chain[-1], 0) if chain and w > 1 else 0)
        bwd = gathered + ub.get(before, 0) + ub.get(after, 0) + grads[v]
        d = g.node(v)
        d["fwd_temp_bytes"] = int(d["fwd_temp_bytes"] + (max(fwd, bwd) if v in recomputed else fwd))
        d["bwd_temp_bytes"] = int(d["bwd_temp_bytes"] + bwd)
    g.meta["loss_fwd_temp_bytes"] = int(g.meta["loss_fwd_temp_bytes"] + root)
    g.meta["loss_bwd_temp_bytes"] = int(g.meta["loss_bwd_temp_bytes"] + root + ub.get(last_unit, 0))
    g.meta["per_rank"] = spec.to_dict()
    return g


def _shard_gradients(g: Graph, spec: ShardingSpec, full: dict[str, int], spans: dict[str, tuple[int, int]]) -> None:
    """Parameter gradients as FSDP holds them: a unit's full-size gradients only while its
    backward runs (node workspace, :func:`_grad_bytes_so_far`), its shard from the end of its
    backward to the end of the step: a gradient entry of its own, first used by the node whose
    backward runs next (the node before the unit in forward order). The model's own parameters'
    shards appear at the end of the backward (nothing after them); unsharded, their gradients
    are plain ones."""
    owner: dict[str, str] = {}
    for v, chain in enumerate(spec.node_units):
        for p in g.node(v)["params"]:
            owner.setdefault(p, chain[-1] if chain else "")
    kept = {p: b for p, b in full.items() if owner.get(p, "") == "" and not spec.root_sharded}
    per_unit: dict[str, int] = {}
    for p, u in owner.items():
        if u:
            per_unit[u] = per_unit.get(u, 0) + full.get(p, 0)
    for u, nbytes in per_unit.items():
        first = spans[u][0]
        if first > 0 and nbytes:
            key = f"fsdp-shard-grad:{u}"
            kept[key] = shard_bytes(spec.unit_bytes.get(u, nbytes), spec.world_size)
            d = g.node(first - 1)
            d["params"] = (*d["params"], key)
    g.meta["param_bytes"] = kept
    for v in g.nodes:
        d = g.node(v)
        d["param_grad_bytes"] = int(sum(kept.get(p, 0) for p in d["params"]))


def _neighbours(spans: dict[str, tuple[int, int]], chain: tuple[str, ...], v: int) -> tuple[str, str]:
    """The unit FSDP prefetches while node ``v``'s backward runs (the last one to end before
    ``v`` in forward order, outside ``v``'s own units) and the one whose reduce-scatter input
    is still held (the first one to start after ``v``)."""
    before, after = "", ""
    for u, (lo, hi) in spans.items():
        if u in chain:
            continue
        if hi < v and (not before or hi > spans[before][1]):
            before = u
        if lo > v and (not after or lo < spans[after][0]):
            after = u
    return before, after


def _grad_bytes_so_far(g: Graph, spec: ShardingSpec, full: dict[str, int]) -> list[int]:
    """Per node: the full-size gradient bytes its innermost unit holds when the node's backward
    runs (parameters first used by the unit's nodes at or after it, in forward order)."""
    out = [0] * len(g)
    by_unit: dict[str, list[int]] = {}
    for v, chain in enumerate(spec.node_units):
        by_unit.setdefault(chain[-1] if chain else "", []).append(v)
    for unit, nodes in by_unit.items():
        if unit == "" and not spec.root_sharded:
            continue
        seen: set[str] = set()
        total = 0
        for v in reversed(nodes):
            for p in g.node(v)["params"]:
                if p not in seen:
                    seen.add(p)
                    total += full.get(p, 0)
            out[v] = total
    return out
