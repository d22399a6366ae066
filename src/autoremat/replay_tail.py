"""The trailing ops of a recomputed segment that its replay can leave out.

A recomputed segment is replayed in backward to get back what its ops saved. An op at the end of
the segment whose output nothing in the segment saves, and which itself saves only tensors the
replay produces anyway (or the segment's inputs, or parameters), need not run again: a
convolution that ends a segment saves its input and its weight, and its output is kept (it is
the segment's output). Kusumoto et al. charge the whole segment ``T(Vi)`` for its
recomputation, and so did autoremat's runtime (it replays up to the segment's last op that
saves); on DenseNet-121 (CPU size) at 30 % of the unoptimised peak a fifth of ``dp-exact``'s
replayed time is such trailing convolutions, feeding on the concatenations the plan drops.

Decisions (each tested):

* the *tail* of a segment is its longest run of last nodes (in execution order) none of which
  the replay needs: not saved by a node of the segment, no saved extras (batch-norm statistics,
  dropout masks: only running the op gives them back), not an input of a node the replay needs,
  and either saving nothing (adds, concatenations, views) or a convolution (:data:`TAIL_KINDS`:
  its saved tensors are its input, as the very object it was given, and its weight), whose
  input is not itself in the tail. Ops with other saving habits (a linear layer on a 3-d input
  saves a reshaped view of it) end the tail: the runtime must hand out exactly what the forward
  saved, and it can vouch for these;
* the replay runs the segment's ops before the tail, in order (none are skipped in between),
  and returns the *tail inputs*: the inputs of the tail's convolutions (the values they save),
  held until the replay ends;
* the runtime checks at every forward that each tensor a tail op saves is one of the tail
  inputs (by identity) or a parameter (or a view of one); where one is not, that forward's
  recomputation replays the whole segment as before (correct, with the memory of a whole
  replay) and logs it once;
* only :func:`autoremat.solve` (and every solver of :data:`autoremat.SOLVERS`) adds the tails to
  a plan (:attr:`Plan.replay_tails <autoremat.plan.Plan.replay_tails>`: segment index -> first
  node of its tail and its tail inputs); the simulator and ``apply`` read them from there, so a
  plan without them (an older JSON file) is simulated and run with whole replays;
* the papers' solvers (``dp-exact``, ``dp-approx``, ...) and ``milp``'s proofs charge a recomputed
  segment's whole replay; ``auto``'s own searches over lower sets (the lattice search and the chain
  search, :mod:`autoremat.solvers.milp`) price it as the plan will run, up to its tail
  (:attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`, :func:`tail_start`: these rules
  on bitsets), and judge their plans' time with the tails (measured in
  :mod:`autoremat.solvers.milp.exact`'s docstring: plans that recompute up to 2.5x less as they
  run). Their bytes stay the whole replay's (the tail's convolutions not run only lower them;
  ``judge`` checks the plan with its tails).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .graph import Graph
from .plan import Plan, ReplayTails

if TYPE_CHECKING:
    from .cost.bitsets import GraphBits

__all__ = ["TAIL_KINDS", "takes_tails", "replay_tail", "replay_tails", "tail_inputs", "tails_of", "tail_start"]

TAIL_KINDS = frozenset({"conv"})
"""Kinds of saving ops a tail may hold: each saves its input tensor and its weight."""


def takes_tails(graph: Graph) -> bool:
    """Whether ``graph``'s plans get replay tails: fx graphs only (module-level regions replay whole
    submodule calls)."""
    return graph.meta.get("mode") == "fx"


def _needed(graph: Graph, nodes: Iterable[int]) -> set[int]:
    """Nodes of the segment the replay must run: those whose outputs a node of the segment
    saves, those with saved extras, and (within the segment) everything they are computed from."""
    members = set(nodes)
    seeds: set[int] = set()
    for v in members:
        d = graph.node(v)
        if not d["requires_grad"]:
            continue
        seeds.update(u for u in d["saves"] if u in members)
        if d["extra_saved_bytes"]:
            seeds.add(v)
    need: set[int] = set()
    stack = list(seeds)
    while stack:
        u = stack.pop()
        if u not in need:
            need.add(u)
            stack.extend(p for p in graph.pred(u) if p in members)
    return need


def replay_tail(graph: Graph, nodes: Iterable[int]) -> int | None:
    """The first node of the segment's tail (see the module docstring), or ``None`` when it has
    none. ``nodes``: the segment's nodes."""
    order = sorted(nodes)
    need = _needed(graph, order)
    first: int | None = None
    blocked: set[int] = set()  # inputs of tail convolutions: the replay produces them
    for v in reversed(order):
        d = graph.node(v)
        if v in need or v in blocked or d["is_output"]:
            break
        saving = d["requires_grad"] and bool(d["saves"] or d["extra_saved_bytes"])
        if saving and d["kind"] not in TAIL_KINDS:
            break
        if saving:
            blocked.update(graph.pred(v))
        first = v
    return first


def tail_start(p: GraphBits, seg: int) -> int:
    """:func:`replay_tail` on bitsets (the models of :mod:`autoremat.cost` that price a replay as
    the plan runs it: :attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`): the first
    node of the tail of the segment ``seg`` (a mask of node ids), or ``-1``. The same rules, held
    to :func:`replay_tail` on random graphs (``tests/test_replay_tail.py``), in ``O(tail)``: the
    scan from the segment's end stops at its first needed node, so every node it passes has only
    unneeded consumers in the segment, and a node is needed there exactly when a node of the
    segment saves it or it has saved extras (``GraphBits.saved_by``, ``GraphBits.extra_mask``)."""
    first, blocked, rest = -1, 0, seg
    stop = p.out_mask | p.extra_mask
    while rest:
        v = rest.bit_length() - 1
        bit = 1 << v
        rest ^= bit
        if (blocked | stop) & bit or p.saved_by[v] & seg:
            break
        if p.holder_mask & bit:
            if p.kind[v] not in TAIL_KINDS:
                break
            blocked |= p.predmask[v]
        first = v
    return first


def tail_inputs(graph: Graph, nodes: Iterable[int], first: int) -> list[int]:
    """The tail inputs of a segment whose tail starts at ``first``: the inputs (in order of first
    use) of its convolutions, none in the tail."""
    out: list[int] = []
    for v in sorted(nodes):
        if v >= first and graph.node(v)["kind"] in TAIL_KINDS:
            out.extend(u for u in graph.pred(v) if u not in out)
    return out


def replay_tails(graph: Graph, plan: Plan) -> ReplayTails:
    """``{segment index: (first node of its tail, its tail inputs)}`` for the recomputed segments
    of ``plan`` that have a tail (none where the graph takes no tails: :func:`takes_tails`)."""
    out: ReplayTails = {}
    if not takes_tails(graph):
        return out
    for i, seg in enumerate(plan.segments):
        if seg.recompute:
            first = replay_tail(graph, seg.nodes)
            if first is not None:
                out[i] = (first, tuple(tail_inputs(graph, seg.nodes, first)))
    return out


def tails_of(plan: Plan) -> dict[int, tuple[int, list[int]]]:
    """The tails recorded in ``plan`` (by :func:`autoremat.solve`): segment index -> (first node
    of the tail, tail inputs)."""
    return {int(k): (int(v[0]), [int(u) for u in v[1]]) for k, v in (plan.replay_tails or {}).items()}
