"""Storages held by nodes no gradient reaches, and the plans that free them.

A node no gradient reaches (``requires_grad`` false, :mod:`autoremat.capture.dead_nodes`) still has an
autograd node while the model runs: what it saved (``unreached_saves``) lives until autograd frees
its graph, and capture measures that as lingering bytes of the ops that run meanwhile
(:mod:`autoremat.capture.lingering`). A recomputed segment runs its forward saving nothing, so a
maker whose every such holder runs in one recomputed segment with it is freed after its last reader:
its lingering bytes go. A maker outside that segment is the segment's input, held by the region's
own autograd node until its graph is freed: it still lingers. This is the simulator's rule
(:func:`lingering_key`); the specialised models count a node's ``fwd_temp_bytes`` whole, as they do
for every lingering byte.

Nor does such a segment hold its inputs to a backward (:func:`held_inputs`): none runs; the region's
own autograd node holds them until its graph is freed. Where capture recorded when that happened
(``meta["dead_released_after"]``, :func:`autoremat.capture.dead_nodes.release_points`) the simulator
holds the region's inputs to that node (:func:`released_after`); else the lingering above counts them.
Measured (CPU, ``EncodecModel`` under bf16 autocast, whose recomputed downsampling convolutions hold
their fp32 inputs while the unpatched step saved bf16 casts of them: no lingering bytes): the least plan
was predicted 0.945x its measured peak without the release point. Measured (CPU,
the Hugging Face ``EncodecModel``): with the encoder's blocks recomputed, the step was predicted
1.28x its measured peak while the simulator held their inputs to backward, 0.9997x without. The
exact models of ``dp-exact`` and ``milp`` (:mod:`.segment_replay`, :mod:`.batch_pricing`) and
dp-approx's closed form do not have this rule: on a graph with ``unreached_saves`` they price such a
segment with its inputs held (above the simulator there, so their plans stay within the budget,
and every plan is simulated), and ``milp``'s proven bounds do not cover plans that free what such
regions hold; on other graphs the rule never applies.

A model output the loss does not read can hold such a graph (CLIP's vision tower under a
text-only loss: its outputs are returned): capture then marks what the graph saved
``held_by_output`` (freed when the loop drops the object), the object's own tensors left out of
``unreached_saves``; where a plan frees a maker as above, the object no longer holds it either
(:func:`unheld`). Measured (CPU, that CLIP configuration): the least plan was predicted 1.082x its
measured peak without this rule, 1.000x with it.

Such a region's recomputation costs no time (no backward replays it), so plans recompute the
stored ones that hold something (:func:`unreached_units`, :func:`recomputing`): every solver's plan
where that lowers the peak (:mod:`autoremat.solvers.unreached_regions`), and the ``blocks`` chain's
gaps always (:func:`autoremat.cost.block_chain.chain_plan`), whose model cannot see it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..graph import Graph
from ..plan import Plan, Segment

__all__ = ["freed_by_recomputation", "held_inputs", "lingering_key", "recomputing", "released_after", "unheld",
           "unreached_units"]


def freed_by_recomputation(g: Graph, plan: Plan, nd: Sequence[dict[str, Any]] | None = None) -> frozenset[int]:
    """The makers (storage roots) whose holders among the nodes no gradient reaches all run in one
    recomputed segment of ``plan`` with them (``nd``: the nodes' attributes, where the caller has them)."""
    nd = [g.node(v) for v in g.nodes] if nd is None else nd
    holders: dict[int, list[int]] = {}
    for v, d in enumerate(nd):
        for u in d["unreached_saves"]:
            holders.setdefault(g.root(u), []).append(v)
    if not holders:
        return frozenset()
    seg_of = {v: i for i, seg in enumerate(plan.segments) if seg.recompute for v in seg.nodes}
    return frozenset(u for u, hs in holders.items() if u in seg_of and all(seg_of.get(h) == seg_of[u] for h in hs))


def held_inputs(seg: Segment, nd: Sequence[dict[str, Any]]) -> bool:
    """Whether segment ``seg`` holds its inputs for a backward: unless it is recomputed and a region no
    gradient reaches (no node of it takes part in backward, one holds ``unreached_saves``)."""
    return not seg.recompute or any(nd[v]["requires_grad"] for v in seg.nodes) or not any(
        nd[v]["unreached_saves"] for v in seg.nodes)


def lingering_key(g: Graph, freed: frozenset[int], ok: Sequence[Hashable]) -> Callable[[int], Hashable | None]:
    """Where a lingering maker's output lives in the forward (``ok``: node -> storage key), for
    :meth:`~autoremat.cost.ledger.StepState.workspace`: ``None`` (not counted) for the makers
    ``freed`` (:func:`freed_by_recomputation`)."""
    if not freed:
        return ok.__getitem__
    return lambda u: None if g.root(u) in freed else ok[u]


def unheld(g: Graph, nd: Sequence[dict[str, Any]], freed: frozenset[int]) -> frozenset[int]:
    """The ``held_by_output`` nodes (no output the loss reads) whose storage is among ``freed``: the returned
    object held them only through the graph no gradient reaches (capture leaves the object's own tensors out
    of ``unreached_saves``), which a plan that frees them no longer keeps."""
    if not freed:
        return frozenset()
    return frozenset(v for v, d in enumerate(nd) if d["held_by_output"] and not d["is_output"] and g.root(v) in freed)


def unreached_units(graph: Graph) -> list[tuple[int, ...]]:
    """The recompute units of ``graph`` (module level, :meth:`~autoremat.graph.Graph.recompute_units`)
    whose nodes all take no part in backward, and of which some hold saved tensors (``unreached_saves``)."""
    if not any(graph.node(v)["unreached_saves"] for v in graph.nodes):
        return []
    return [u for u in graph.recompute_units()
            if not any(graph.node(v)["requires_grad"] for v in u) and any(graph.node(v)["unreached_saves"] for v in u)]


def recomputing(segments: Sequence[Segment], units: Sequence[tuple[int, ...]]) -> list[Segment]:
    """``segments`` with each of ``units`` that runs inside a stored segment split out of it as a
    recomputed segment of its own (a new list, equal to ``segments`` when none does)."""
    start = {u[0]: u for u in units}
    out: list[Segment] = []
    for seg in segments:
        if seg.recompute or not start.keys() & set(seg.nodes):
            out.append(seg)
            continue
        run: list[int] = []
        i, nodes = 0, seg.nodes
        while i < len(nodes):
            unit = start.get(nodes[i])
            if unit is not None and nodes[i:i + len(unit)] == unit:
                out += [Segment(tuple(run), recompute=False)] if run else []
                out.append(Segment(unit, recompute=True))
                run, i = [], i + len(unit)
            else:
                run.append(nodes[i])
                i += 1
        out += [Segment(tuple(run), recompute=False)] if run else []
    return out


def released_after(g: Graph, plan: Plan, nd: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Segment index -> the node after which the recomputed region no gradient reaches (``held_inputs``
    false) stops holding its inputs: its graph was freed there in the recorded forward (``-1``: after the
    forward). Segments capture has no release point for are left out."""
    points = dict((int(v), int(at)) for v, at in g.meta.get("dead_released_after", ()))
    if not points:
        return {}
    out: dict[int, int] = {}
    for si, seg in enumerate(plan.segments):
        if held_inputs(seg, nd):
            continue
        ats = [points[v] for v in seg.nodes if v in points]
        if ats:
            out[si] = -1 if -1 in ats else max(ats)
    return out
