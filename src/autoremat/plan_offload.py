"""What a plan may offload, and where: storages kept for backward and module calls' own saved tensors.

Two kinds of *offload unit* (:mod:`autoremat.cost.offload_link` moves each as one transfer):

* a node's output storage (``Plan.offload``), kept for backward by the nodes that save it and the
  recomputed segments that take it as an input (:func:`offloadable_nodes`);
* a node's **own saved tensors** (``Plan.offload_saved``): what the node's autograd graph keeps
  for backward besides node outputs (``extra_saved_bytes``: a Transformer block's attention
  probabilities, MLP activations, dropout masks), as one unit: copied to host when the node's
  forward ends, brought back before its backward — ``torch.autograd.graph.save_on_cpu`` scoped to
  one module call (:func:`saved_unit_nodes`; the runtime: :mod:`autoremat.runtime.offload_saved`).

Where a field holds units of both kinds (``Plan.offload_order``, the values of
``Plan.offload_waits``, :attr:`~autoremat.cost.Simulation.offload_releases`), node ``v``'s output is
``v`` and its own saved tensors are ``-1 - v`` (:func:`saved_unit`; ``~v`` in Python).

Decisions: a node of a recomputed segment saves nothing in forward (its replay saves again just
before its backward), so offloading its own saved tensors is refused, not ignored. At op level
(fx captures) a node's own saved tensors are small (batch-norm statistics, dropout masks) and the
runtime does not scope single ops: ``offload_saved`` is for module-level graphs (and graphs without
a capture mode, for the solvers' tests). Where blocks were captured op by op (``blocks="auto"``), a
block's first node in ``offload_saved`` stands for its whole call: everything the block's ops save
(:mod:`autoremat.region_units`); other ops of a block are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from .call_names import is_per_call, plain_path
from .errors import PlanFormatError, PlanMismatchError
from .graph import Graph
from .region_units import region_unit, region_units

if TYPE_CHECKING:
    from .plan import Plan, Segment

__all__ = ["offloadable_nodes", "region_stop", "wait_points", "release_waits", "saved_unit", "unit_node",
           "saved_unit_nodes", "offload_units", "unit_bytes", "check_offload_saved", "offload_calls_of"]


def saved_unit(v: int) -> int:
    """The unit id of node ``v``'s own saved tensors (``-1 - v``)."""
    return -1 - int(v)


def unit_node(u: int) -> int:
    """The node of unit ``u`` (its output's storage, or its own saved tensors)."""
    return -1 - u if u < 0 else u


def offload_units(plan: "Plan") -> tuple[int, ...]:
    """Every unit the plan offloads: ``plan.offload`` and the units of ``plan.offload_saved``."""
    return tuple(plan.offload) + tuple(saved_unit(v) for v in plan.offload_saved)


def offload_calls_of(graph: Graph, plan: "Plan") -> dict[int, str]:
    """``Plan.offload_calls``: each node the runtime hooks for an offload (``offload``,
    ``offload_saved``, the keys of ``offload_waits``) that sits in one call of a module run more
    than once per step -> that call, ``"<path>@<k>/<n>"``. The hooked module is the node's own at
    module level (a module call) or the block whose call runs the op (a block captured op by op:
    the outermost call of its scope)."""
    if graph.meta.get("mode") != "module":
        return {}
    out = {}
    for v in {*plan.offload, *plan.offload_saved, *plan.offload_waits}:
        d = graph.node(v)
        scope = tuple(d.get("scope") or ())
        own = [c for c in scope if plain_path(c) == d["module_path"]] if d["op_index"] < 0 else list(scope[:1])
        if own and is_per_call(own[0]):
            out[v] = own[0]
    return out


def unit_bytes(graph: Graph, u: int) -> int:
    """Bytes one transfer of unit ``u`` moves."""
    d = graph.node(unit_node(u))
    ru = region_unit(graph, -1 - u) if u < 0 else None
    if ru is not None:
        return ru.nbytes
    return int(d["extra_saved_bytes"] if u < 0 else d["alloc_bytes"])


def saved_unit_nodes(graph: Graph, plan: "Plan") -> set[int]:
    """Nodes whose own saved tensors ``plan`` may offload (``Plan.offload_saved``): outside its
    recomputed segments, taking part in backward, saving something besides node outputs; at module
    level module calls only; none in an fx capture (see the module docstring)."""
    mode = graph.meta.get("mode")
    if mode == "fx":
        return set()
    recomputed = plan.recomputed_nodes
    out = set()
    for v in graph.nodes:
        d = graph.node(v)
        if mode == "module" and d["op_index"] >= 0:  # an op of a block: the block's first, as its region
            ru = region_unit(graph, v)
            if ru is not None and ru.nbytes > 0 and not recomputed.intersection(ru.nodes):
                out.add(v)
            continue
        if v in recomputed or not d["requires_grad"] or d["extra_saved_bytes"] <= 0:
            continue
        if mode == "module" and d["kind"] == "glue":
            continue
        out.add(v)
    return out


def check_offload_saved(graph: Graph, plan: "Plan") -> None:
    """``plan.offload_saved`` against ``graph``: a clear error for each kind of bad node."""
    if not plan.offload_saved:
        return
    mode = graph.meta.get("mode")
    if mode == "fx":
        raise PlanFormatError("offload_saved", f"names nodes {list(plan.offload_saved)[:5]} of an op-level (fx) "
                              "capture: offloading a node's own saved tensors runs around module calls; capture with "
                              "mode='module', or offload the nodes' outputs (offload)")
    recomputed = plan.recomputed_nodes
    for v in plan.offload_saved:
        if not 0 <= v < len(graph):
            raise PlanMismatchError(f"offload_saved names node {v}, but the graph has {len(graph)} nodes (ids "
                                    f"0..{len(graph) - 1}); capture this model and solve again")
        d = graph.node(v)
        where = f"offload_saved: node {v} ({d['name']})"
        if mode == "module" and d["op_index"] >= 0:
            _check_region_unit(graph, plan, v, where)
            continue
        if v in recomputed:
            raise PlanFormatError("offload_saved", f"{where} is in a recomputed segment: it saves nothing in forward "
                                  "(its replay saves again just before its backward), so there is nothing to "
                                  "offload; drop it from offload_saved or keep its segment")
        if not d["requires_grad"] or d["extra_saved_bytes"] <= 0:
            raise PlanFormatError("offload_saved", f"{where} saves no tensors of its own for backward (extra_saved_"
                                  f"bytes={d['extra_saved_bytes']}, requires_grad={d['requires_grad']}); offload its "
                                  "output instead (offload), or drop it")
        if mode == "module" and d["kind"] == "glue":
            raise PlanFormatError("offload_saved", f"{where} is not a module call (a glue op): the runtime "
                                  "offloads the saved tensors of module calls")


def _check_region_unit(graph: Graph, plan: "Plan", v: int, where: str) -> None:
    """An op of a block captured op by op in ``offload_saved``: the first node of a block region
    whose call can be offloaded as one unit (:mod:`autoremat.region_units`), else a clear error."""
    ru = region_unit(graph, v)
    if ru is None:
        scope = graph.node(v)["scope"]
        path = scope[0] if scope else graph.node(v)["module_path"]
        pinned = set(graph.meta.get("pinned_regions", ()))
        if path in pinned:
            why = (f"its block {path!r} is pinned (graph.meta['pinned_regions']: an input written in place, or "
                   "a key/value cache the call writes), so its saved tensors are not one call's own")
        elif path in graph.call_regions() and graph.call_regions()[path][0] == v:
            why = f"its block {path!r} is not one call (its ops are not consecutive)"
        else:
            firsts = sorted(region_units(graph))[:5]
            why = (f"it is not the first op of a block captured op by op (the first ops of the blocks that "
                   f"can be offloaded whole: {firsts})")
        raise PlanFormatError("offload_saved", f"{where} is an op of a block captured op by op, and {why}; "
                              "name a block's first op to offload all it saves, or drop it")
    if plan.recomputed_nodes.intersection(ru.nodes):
        raise PlanFormatError("offload_saved", f"{where} is the first op of block {ru.path!r}, which the plan "
                              "also recomputes: a recomputed block saves nothing in forward (its replay saves "
                              "again just before its backward); keep the block, or drop it from offload_saved")
    if ru.nbytes <= 0:
        raise PlanFormatError("offload_saved", f"{where}: block {ru.path!r} saves nothing of its own for "
                              "backward; drop it from offload_saved")



def offloadable_nodes(graph: Graph, plan: Plan) -> set[int]:
    """Storage roots the plan keeps for backward: saved by some node outside the plan's recomputed
    segments, or an input of a recomputed segment whose replay runs (:func:`region_stop`). In
    module-level graphs glue ops (tensor code between module calls) and the ops of a block
    captured op by op are left out: the runtime marks outputs of module calls only; but the op
    whose output a block returns stands for the block's call (:attr:`~autoremat.region_units.RegionUnit.output`)."""
    recomputed = plan.recomputed_nodes
    module = graph.meta.get("mode") == "module"
    returned = {ru.output for ru in region_units(graph).values()} if module else set()
    out: set[int] = set()
    for w in graph.nodes:
        d = graph.node(w)
        if w in recomputed or not d["requires_grad"]:
            continue
        for u in d["saves"]:
            r = graph.root(u)
            if graph.node(r)["alloc_bytes"] > 0 and (r in returned or not (module and graph.node(r)["op_index"] >= 0)):
                out.add(r)
    for seg in plan.segments:
        if seg.recompute and region_stop(graph, seg) >= 0:
            members = set(seg.nodes)
            for u in {u for v in seg.nodes for u in graph.pred(v) if u not in members}:
                if graph.node(graph.root(u))["alloc_bytes"] > 0:
                    out.add(graph.root(u))
    if module:
        out = {r for r in out if r in returned or (graph.node(r)["kind"] != "glue" and graph.node(r)["op_index"] < 0)}
    return out


def region_stop(graph: Graph, seg: Segment) -> int:
    """The node of recomputed ``seg`` whose backward replays it: its last node that saves something
    for backward (PyTorch's early stop); -1 when it saves nothing or is not recomputed."""
    if not seg.recompute:
        return -1
    holders = [v for v in seg.nodes if (graph.node(v)["saves"] or graph.node(v)["extra_saved_bytes"])
               and graph.node(v)["requires_grad"]]
    return max(holders) if holders else -1


def release_waits(graph: Graph, plan: Plan, releases: Mapping[int, int]) -> dict[int, int]:
    """``plan.offload_waits`` with a wait added where the simulator releases offloaded device
    copies (``releases``: node -> the last of them in issue order,
    :attr:`~autoremat.cost.Simulation.offload_releases`), at the nodes the runtime can wait at.

    The runtime otherwise releases a device copy when the CPU sees its copy complete; a CPU that
    runs ahead of the GPU sees that late and holds the memory on (an H200 measured a U-Net offload
    plan at 0.770x of the unpatched peak against 0.599x predicted). A wait makes the compute stream
    wait for the copy before the node and drops the device copies issued up to it, so the memory is
    free at the simulator's point in the GPU's order; the simulator's copy is complete there, so
    the wait costs no predicted time and the prediction is unchanged. An explicit wait already at a
    node is kept."""
    points = wait_points(graph, plan)
    waits = dict(plan.offload_waits)
    for v, r in releases.items():
        if v in points and v not in waits:
            waits[int(v)] = int(r)
    return waits


def wait_points(graph: Graph, plan: Plan) -> set[int]:
    """Nodes before which the runtime can make the forward wait for a copy to host: nodes outside
    the recomputed segments and the first node of each recomputed segment (the wait comes before
    the region); at module level only module calls (not glue ops, nor the ops of a block captured
    op by op: the runtime hooks module calls), the first op of such a block standing for its call
    (:mod:`autoremat.region_units`)."""
    out: set[int] = set()
    module = graph.meta.get("mode") == "module"
    blocks = region_units(graph) if module else {}
    for seg in plan.segments:
        nodes = seg.nodes[:1] if seg.recompute else seg.nodes
        out.update(v for v in nodes if v in blocks or not (module and (graph.node(v)["kind"] == "glue"
                                                                       or graph.node(v)["op_index"] >= 0)))
    return out
