"""Repeated blocks of a graph: the layers a chain solver plans one class at a time.

A node's *block* is the outermost entry of its ``scope`` whose last dotted component is an
integer: a member of a module container (``model.layers.3``, ``encoder.block.0``,
``blocks.12``). A block is the maximal run of consecutive nodes with the same block path; a
path whose nodes are not one run is no block (its nodes stay in the gaps). Two blocks are
*identical* (one class) when their nodes match one to one in kind, op, bytes (output, new
storage, saved extras, workspace), parameter-gradient bytes, flags, op index and the pattern
of their edges, views and saved tensors relative to the block (the edges from outside by the
position of the input among the block's inputs): same module class, same shapes, same
subgraph. Times are left out (they are measured, so noisy); a class uses its blocks' median
times where it needs one.

Time O(n + e) for ``n`` nodes and ``e`` edges.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from ...call_names import plain_path
from ...graph import Graph

__all__ = ["Blocks", "find_blocks", "block_path"]


@dataclass(frozen=True)
class Blocks:
    """Blocks in execution order (``paths``, ``nodes``: contiguous id ranges) and the class of
    each (``classes``: identical blocks share the number of the first of them)."""

    paths: tuple[str, ...]
    nodes: tuple[tuple[int, ...], ...]
    classes: tuple[int, ...]

    @property
    def repeated(self) -> int:
        """Blocks that have an identical block before them."""
        return sum(1 for j, c in enumerate(self.classes) if c != j)


def block_path(scope: tuple[str, ...]) -> str | None:
    """The outermost scope entry that is a container member (its last component an integer)."""
    for path in scope:
        if plain_path(path).rpartition(".")[2].isdigit():
            return path
    return None


def _runs(graph: Graph) -> list[tuple[str, list[int]]]:
    runs: list[tuple[str, list[int]]] = []
    for v in graph.nodes:
        path = block_path(graph.node(v)["scope"])
        if path is None:
            continue
        if runs and runs[-1][0] == path and runs[-1][1][-1] == v - 1:
            runs[-1][1].append(v)
        else:
            runs.append((path, [v]))
    return runs


def _signature(graph: Graph, path: str, nodes: list[int]) -> Hashable:
    first = nodes[0]
    regions = graph.call_regions()
    inside = set(nodes)
    external: dict[int, int] = {}

    def ref(u: int) -> tuple[str, int]:
        if u in inside:
            return ("in", u - first)
        return ("ext", external.setdefault(u, len(external)))

    sig = []
    for v in nodes:
        d = graph.node(v)
        base = plain_path(path)
        target = d["target"][len(base):] if d["target"].startswith(base + ".") else d["target"]  # fx module calls
        sig.append((d["kind"], target, d["out_bytes"], d["alloc_bytes"], d["extra_saved_bytes"],
                    d["fwd_temp_bytes"], d["bwd_temp_bytes"], d["param_grad_bytes"], d["requires_grad"],
                    d["grad_passthrough"], d["first_grad_view"], d["is_output"], d["held_by_output"], d["recomputable"],
                    d["op_index"],
                    None if d["alias_of"] is None else ref(d["alias_of"]),
                    tuple(ref(u) for u in d["saves"]), tuple(ref(u) for u in graph.pred(v)), _relative(d["scope"], path, regions),
                    tuple(ref(u) for u in d["unreached_saves"])))
    return tuple(sig)


def _relative(scope: tuple[str, ...], path: str, regions: dict[str, tuple[int, ...]]) -> tuple[tuple[str, bool], ...]:
    """The node's scope from the block down, relative to the block's path, and whether each call
    is a region a plan may recompute."""
    inner = scope[scope.index(path):]
    base = len(plain_path(path))
    return tuple((plain_path(p)[base:], p in regions) for p in inner)


def find_blocks(graph: Graph) -> Blocks:
    """The blocks of ``graph`` and their classes (module docstring)."""
    runs = _runs(graph)
    count: dict[str, int] = {}
    for path, _ in runs:
        count[path] = count.get(path, 0) + 1
    # a block no gradient reaches has nothing to plan: a gap (whose regions chain_plan recomputes, cost.unreached)
    runs = [(p, vs) for p, vs in runs if count[p] == 1 and any(graph.node(v)["requires_grad"] for v in vs)]
    classes: list[int] = []
    seen: dict[Hashable, int] = {}
    for j, (_p, vs) in enumerate(runs):
        classes.append(seen.setdefault(_signature(graph, _p, vs), j))
    return Blocks(paths=tuple(p for p, _ in runs), nodes=tuple(tuple(vs) for _, vs in runs), classes=tuple(classes))
