"""The local plans a block may run (its *options*), over node offsets from its first node.

* ``store``: nothing recomputed (option 0, the chain model's reference);
* ``whole``: the block as one recomputed region (at module level, when the block's call is a
  call region a plan may recompute; at op level, when all its nodes are recomputable);
* ``split``: some of its *parts* recomputed, each as its own region, the nodes between them
  stored (a part is a direct sub-module call of the block: ``self_attn``, ``mlp``...; at
  module level a call region, at op level a run of recomputable nodes): every non-empty subset
  of the parts when there are at most ``max_parts`` of them, else all, each one alone, and all
  but each one. Splitting keeps each part's input but bounds the replay to one part at a time;
* ``keep``: at module level only (selective checkpointing runs there), ``whole`` and the
  split with all parts recomputed, each region keeping the op outputs that a 0/1 knapsack
  (:func:`autoremat.solvers.selective_saves.choose_saves`) picks within a fraction of the
  region's bytes, for each fraction of ``keep_fractions``: the ops that save the most replay
  time per byte kept (matmuls, attention) before the cheap ones; never an op whose output is
  written in place later (:func:`written_in_place`), nor the replay's stop node where the replay
  stops before it runs (:func:`autoremat.cost.simulator.stops_before_running`: keeping it saves
  no time and its stored output stays cached to the end of the segment's backward), nor a random
  op (``random``: the runtime replays it so that the RNG advances as in the forward). Not for a
  call of a module run more than once per step (``"<path>@<k>/<n>"``, ALBERT's shared layer
  group): the runtime refuses selective saves in one such call under autocast
  (:mod:`autoremat.runtime.per_call`), so its options recompute whole or split.

Options with the same segments are listed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...call_names import is_per_call
from ...cost.simulator import stops_before_running
from ...graph import Graph
from ...plan import Segment
from ..selective_saves import choose_saves

__all__ = ["block_options", "block_parts", "written_in_place"]


def block_parts(graph: Graph, path: str, nodes: Sequence[int]) -> list[tuple[int, ...]]:
    """The block's parts in order: the node sets of its direct sub-module calls that a plan may
    recompute as one region (module level: call regions; op level: runs of recomputable nodes)."""
    module = graph.meta.get("mode") == "module"
    regions = graph.call_regions()
    parts: dict[str, list[int]] = {}
    for v in nodes:
        scope = graph.node(v)["scope"]
        inner = scope[scope.index(path) + 1:]
        child = next((p for p in inner if p in regions), None) if module else (inner[0] if inner else None)
        if child is not None:
            parts.setdefault(child, []).append(v)
    out = []
    for child, vs in parts.items():
        contiguous = vs == list(range(vs[0], vs[0] + len(vs)))
        if module:
            ok = regions.get(child) == tuple(vs)
        else:
            ok = contiguous and all(graph.node(v)["recomputable"] for v in vs)
        if ok and any(graph.node(v)["saved_bytes"] > 0 for v in vs):
            out.append(tuple(vs))
    return out


def _whole_ok(graph: Graph, path: str, nodes: Sequence[int]) -> bool:
    if graph.meta.get("mode") == "module":
        return graph.region_of(nodes) == path
    return all(graph.node(v)["recomputable"] for v in nodes)


def _stop(graph: Graph, nodes: Sequence[int]) -> int:
    """The last node of a region whose replay is needed (it saves something): PyTorch's early stop."""
    holders = [v for v in nodes if graph.node(v)["requires_grad"] and (graph.node(v)["saves"]
                                                                       or graph.node(v)["extra_saved_bytes"])]
    return max(holders) if holders else -1


def written_in_place(graph: Graph) -> set[int]:
    """Storage roots an in-place op writes (its ATen name ends with ``_``, ``aten.bernoulli_.float``):
    an output kept by selective checkpointing must not be one (PyTorch refuses a mutated cached
    tensor, and the replay would hand on the written value)."""
    out = set()
    for v in graph.nodes:
        d = graph.node(v)
        parts = str(d["target"]).split(".")
        if d["alias_of"] is not None and len(parts) >= 3 and parts[0] == "aten" and parts[1].endswith("_"):
            out.add(graph.root(v))
    return out


def _kept(graph: Graph, region: Sequence[int], fraction: float, times: Mapping[int, float],
          written: set[int] | None = None) -> tuple[int, ...]:
    """The ops of ``region`` a knapsack keeps within ``fraction`` of its items' bytes (``written``:
    :func:`written_in_place` of the graph, where the caller has it: it reads every node)."""
    stop = _stop(graph, region)
    written = written_in_place(graph) if written is None else written
    last = stop - 1 if stops_before_running(graph, stop) else stop  # the replay never runs its stop node
    items = [v for v in region if v <= last and graph.node(v)["op_index"] >= 0 and graph.node(v)["alias_of"] is None
             and graph.node(v)["alloc_bytes"] > 0 and times[v] > 0 and v not in written and not graph.node(v)["random"]]
    total = sum(graph.node(v)["alloc_bytes"] for v in items)
    if not items or total <= 0:
        return ()
    chosen = choose_saves([(graph.node(v)["alloc_bytes"], times[v]) for v in items], int(fraction * total))
    return tuple(items[i] for i in chosen)


def _segments(nodes: Sequence[int], regions: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[Segment, ...]:
    """Segments over offsets: each (region, kept) recomputed, the runs between stored."""
    first = nodes[0]
    start = {r[0]: (r, keep) for r, keep in regions}
    segs: list[Segment] = []
    run: list[int] = []
    v = nodes[0]
    while v <= nodes[-1]:
        if v in start:
            if run:
                segs.append(Segment(tuple(u - first for u in run), recompute=False))
                run = []
            region, keep = start[v]
            segs.append(Segment(tuple(u - first for u in region), True, tuple(u - first for u in keep)))
            v = region[-1] + 1
        else:
            run.append(v)
            v += 1
    if run:
        segs.append(Segment(tuple(u - first for u in run), recompute=False))
    return tuple(segs)


def _subsets(count: int, max_parts: int) -> list[tuple[int, ...]]:
    if count <= max_parts:
        return [tuple(i for i in range(count) if mask >> i & 1) for mask in range(1, 1 << count)]
    every = tuple(range(count))
    return [every] + [(i,) for i in every] + [tuple(k for k in every if k != i) for i in every]


def block_options(graph: Graph, path: str, nodes: Sequence[int], times: Mapping[int, float], *,
                  keep_fractions: Sequence[float], max_parts: int) -> list[tuple[str, tuple[Segment, ...]]]:
    """The options of the block at ``path`` (module docstring), ``store`` first; ``times``: the
    forward time the knapsack values each node at (the class's median)."""
    found: dict[tuple[Segment, ...], str] = {_segments(nodes, []): "store"}

    def add(name: str, regions: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        found.setdefault(_segments(nodes, regions), name)

    module = graph.meta.get("mode") == "module"
    # a call of a shared module (ALBERT's layer group) recomputes whole or split, keeping no op
    # outputs: selective saves in one call cannot run exactly under autocast (autoremat.runtime.per_call)
    keeps = keep_fractions if module and not is_per_call(path) else ()
    written = written_in_place(graph) if keeps else set()
    whole = tuple(nodes)
    if _whole_ok(graph, path, nodes) and _stop(graph, whole) >= 0:
        add("whole", [(whole, ())])
        for f in keeps:
            add(f"whole+keep{f:g}", [(whole, _kept(graph, whole, f, times, written))])
    parts = block_parts(graph, path, nodes)
    for subset in _subsets(len(parts), max_parts):
        add("split" + "".join(str(i) for i in subset), [(parts[i], ()) for i in subset])
    if parts:
        for f in keeps:
            add(f"split+keep{f:g}", [(p, _kept(graph, p, f, times, written)) for p in parts])
    return [(name, segs) for segs, name in found.items()]
