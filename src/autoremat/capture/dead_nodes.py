"""Nodes no gradient reaches: autograd frees them without running their backward.

A model can run ops with gradients enabled whose results the loss never depends on. The Hugging
Face ``EncodecModel`` encodes its input into integer codes (``argmax`` over distances to a codebook)
and decodes the codes: its encoder runs with parameters that require gradients, so autograd
records it and its ops save their inputs, but no gradient can reach it from the loss. Its autograd
graph is freed, saved tensors and all, as soon as nothing refers to it any more (when ``encode``
returns), and its backward never runs: no gradients for its outputs or parameters. Modelled as
ordinary nodes, their saved tensors stayed to a backward that never comes: the unpatched step was
predicted 1.78x its measured peak.

A node is *dead* when it takes part in autograd (``requires_grad``), is no output the loss reads,
and every node that reads it is dead or takes no part in autograd (an integer result, a
comparison, a ``no_grad`` region). Views are the exception: readers link to a storage's owner (the
node that made it or last wrote it in place), so a view with no reader of its own is not evidence
of anything; it is dead with its root. The test is on the recorded graph, not on autograd's: it is
exact where the graph's edges are autograd's (an op that reads a tensor without differentiating
it, ``torch.where``'s condition, ``index``'s indices, is an integer or boolean read anyway).

What a dead node gets (:func:`settle_dead_nodes`): no part in backward (``requires_grad`` off; its
backward never ran, so it has no backward region, workspace or time), and its saves move to
``unreached_saves``: not held to a backward. Its saved extras count only while it runs, as for any
node outside backward. Its saved tensors still live in the forward until autograd frees its graph:
the storages that outlive their last reader that way are what :mod:`.lingering` already measures (a
maker's output alive after its last reader, saved by no live node), and so are a dead node's own
saved outputs (``max``'s indices); they count as lingering bytes of the ops that run while they are
alive. A dead node's saved storages made inside a module call (no node's output) are left out.

Recomputation removes them: a checkpointed region saves nothing in its forward, so what its dead
nodes would hold dies after its last reader, and a region no gradient reaches holds no inputs for
a backward; recomputing such a region costs no time (nothing replays it). The simulator's rules are
in :mod:`autoremat.cost.unreached`; every plan recomputes the stored regions no gradient reaches
where that lowers the peak (:mod:`autoremat.solvers.unreached_regions`). The lingering bytes of a
maker a dead node holds are all taken to be that node's (a local of the model's code holding it too
is not told apart).

Measured (CPU, the Hugging Face ``EncodecModel`` of :mod:`autoremat.zoo.hf_breadth`): unpatched step
predicted 1.78x the measured peak before, 1.0005x now; the least plan 1.34x before, 0.9997x now.

Where a plan recomputes such a region, the region's own autograd node holds its inputs until the
graph is freed: a graph fact capture records (:func:`release_points`, the graph's
``meta["dead_released_after"]``): for each connected set of dead nodes, the node after which the
storages they saved died in the recorded forward (``-1``: they outlived it), which the simulator
holds a recomputed dead region's inputs to (:mod:`autoremat.cost.unreached`). Under bf16 autocast
Encodec's downsampling convolutions save a bf16 cast of their input, so the fp32 input dies at once
in the unpatched step and no lingering bytes showed what the recomputed region holds: its least plan
was predicted 0.945x the measured peak without the release point.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

__all__ = ["dead_nodes", "settle_dead_nodes", "release_points"]


def dead_nodes(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], root: Callable[[int], int]) -> set[int]:
    """The records of ``nodes`` no gradient reaches (module docstring); ``succs``: node -> readers,
    ``root``: the node whose storage a node's output lives in."""
    def bare_view(w: int) -> bool:
        return nodes[w].alias_of is not None and not succs.get(w)

    dead: set[int] = set()
    for v in range(len(nodes) - 1, -1, -1):
        r = nodes[v]
        if not r.requires_grad or r.is_output or bare_view(v):
            continue
        if all(w in dead or not nodes[w].requires_grad or bare_view(w) for w in succs.get(v, ())):
            dead.add(v)
    dead |= {v for v, r in enumerate(nodes) if r.requires_grad and bare_view(v) and root(v) in dead}
    return dead


def settle_dead_nodes(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], root: Callable[[int], int],
                      returned: Collection[int] = ()) -> set[int]:
    """Take the dead nodes (:func:`dead_nodes`) out of backward; returns them. Call before
    :meth:`.lingering.Lingering.apply`, which then counts their saved storages while alive.
    ``returned``: the nodes whose storage a tensor of the returned object is; held by the object
    anyway, they are left out of ``unreached_saves`` (a plan freeing what dead nodes hold does
    not free them)."""
    dead = dead_nodes(nodes, succs, root)
    kept = {root(u) for u in returned}
    for v in dead:
        r = nodes[v]
        r.requires_grad = False
        r.unreached_saves, r.saves = {u for u in r.saves if root(u) not in kept}, set()
    return dead


def release_points(nodes: Sequence[Any], succs: Mapping[int, Sequence[int]], root: Callable[[int], int],
                   dead: Collection[int], deaths: Mapping[int, Sequence[tuple[int, int]]], alive: Collection[int],
                   ops: Sequence[int]) -> dict[int, int]:
    """Dead node -> the node after which autograd freed its graph in the recorded forward (``-1``: after
    the forward): per connected set of dead nodes (edges between them, views to their roots), the last
    death in the forward of a storage they saved (``unreached_saves``); ``-1`` where none died in it but
    some outlived it. A storage that outlives the forward while others of the set died in it is held by
    something else (autocast's cache of weight casts, freed when the autocast region exits).

    ``deaths``: maker -> (ops run when one of its storages died, bytes), from
    :class:`.lingering.Lingering`; ``alive``: the makers with a storage still alive when the forward
    ended; ``ops``: the nodes in the order they ran. Sets whose nodes saved nothing get no entry."""
    parent = {v: v for v in dead}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for v in dead:
        for w in (*succs.get(v, ()), root(v)):
            if w in parent:
                parent[find(w)] = find(v)
    groups: dict[int, list[int]] = {}
    for v in dead:
        groups.setdefault(find(v), []).append(v)
    out: dict[int, int] = {}
    for members in groups.values():
        makers = {root(u) for v in members for u in nodes[v].unreached_saves}
        if not makers:
            continue
        last = max((pos for m in makers for pos, _ in deaths.get(m, ())), default=0)
        if 0 < last <= len(ops):  # what outlived the forward besides is held otherwise (autocast's weight casts)
            out.update((v, ops[last - 1]) for v in members)
        elif makers & set(alive):
            out.update((v, -1) for v in members)
    return out
