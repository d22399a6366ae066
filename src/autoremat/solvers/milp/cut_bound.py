"""A lower bound of the least extra time from the backward's separators (``milp``'s third bound).

The lattice search (:mod:`.lattice`) proves its bounds by enumerating lower sets; on graphs with
many (GoogLeNet and Inception-v3 at CPU size: four interleaved branches per module) its cost-to-go
cannot be built in time and its proven bound stays far below the best plan (GoogLeNet at 50 %:
3.0e-7 s against a best plan of 1.07e-6 s). This bound looks instead at the moments every plan
shares.

**The moments.** A node ``c`` is a *separator* when every node before it (in execution order)
is an ancestor of ``c``, every node after it a descendant, and no edge goes from a node before it
to one after it. Every plan the runtime executes (canonical strategies: an increasing sequence of
lower sets) then runs the backward of exactly the nodes after ``c`` before ``c``'s, so the moment
``c``'s backward starts, ``M_c``, is the same in all plans; and the only gradient pending there is
``c``'s own, so what the gradients hold does not depend on the order the nodes after ``c`` ran in
(with an edge over ``c``, an earlier node's gradient buffers, shared through pass-through nodes and
summed out of place, do: a brute-force test found a plan 9 bytes below such a level). What is
live at ``M_c`` splits into

* what no plan changes there (``base_c``): gradients, parameter gradients, ``c``'s own saved
  tensors and workspace, storages held to the step's end: the simulator's level at ``c``'s
  backward without recomputation (:func:`~autoremat.cost.simulator.step_levels`) less every
  storage of a node before ``c`` that a plan could drop there (the storages nodes before ``c``
  save, their saved extras, and what nodes no gradient reaches hold); leaving out more than a
  plan can drop only lowers the bound;
* the storages ``X`` of nodes before ``c`` that a plan holds at ``M_c`` (``h[X, c]``).

**The relaxation** (one program over the chosen separators; every canonical strategy maps to a
feasible point no dearer than its extra time and no larger in bytes at any ``M_c``):

* ``a[v, c]``: ``v`` runs in a replay after ``M_c``; ``p[v, c]``: ``v``'s segment is recomputed
  and replayed after ``M_c``; ``r[v]``: ``v`` runs in some replay (cost: its forward time; a node
  runs in at most one replay in these plans). ``a[v, c] <= p[v, c]``, ``a[v, c] <= r[v]``, and
  ``a[v, c] <= a[v, c']`` for separators ``c < c'`` (once replayed, a node's output stays until
  its backward, so it is absent on an interval of moments from the backward's start).
* A storage a node ``u`` before ``c`` saves is dropped only inside a recomputed segment whose
  replay is to come, and comes back only when its node runs again: ``h[X] + p[u] >= 1`` and
  ``h[X] + a[x] >= 1`` for ``u`` saving ``x`` with storage ``X``. A node's saved extras are held
  unless ``p[u]``; a node whose saved tensors include its own output or extras runs in its
  segment's replay (``p[u] <= a[u]``); one that saves only its inputs may be where the replay
  stops (PyTorch's early stop packs them before it runs), so it costs nothing there.
* A node that runs in a replay reads its inputs: each is run before it in the same replay or
  held (a recomputed segment keeps its inputs): ``a[v] <= h[X] + a[x]`` for every input ``x``.
* Memory at ``M_c``: ``base_c + sum(h[X, c] bytes(X)) + held extras <= budget``.

Objective: ``sum(r[v] time(v))``, a lower bound of every plan's extra time replayed whole (and
with replay tails: a tail's nodes do not run and what they save is held from forward, which the
relaxation allows). Ignored, so only lowering the bound: the replay's own transient memory
between separators, a replay's nodes up to its stop that nothing needs, and the order within it.

Separators: those where the unpatched level is above the budget (the others do not bind alone),
at most :data:`MAX_CUTS` of them (the highest); leaving some out only weakens the bound. A graph
with none gets no bound (``0``). Solved with HiGHS (:mod:`.highs`) within a time limit; the
program's dual bound is the answer (proven when the limit stops it too).

Measured (x86_64, 2 cores, CPU only, zoo models at CPU size on the meta device, 2026-11-29):
GoogLeNet (26 separators) at 50 % 8.16e-7 s in ~9 s, at ``milp``'s least budget 9.98e-7 s, against
the lattice's 3.0e-7 / 5.0e-7 s after 45 s (best plans known 1.07e-6 / 1.35e-6 s); Inception-v3
(32 separators, no lattice) 7.93e-7 s at 75 % (best plan 1.06e-6 s), and 50 % proven infeasible;
ResNet-50 (39 separators) at 50 % 1.465e-6 s against the proven optimum 1.490e-6 s; PSPNet (49) at
75 % 1.052e-6 s (best plan 1.19e-6 s; 36 s to close); on DenseNet-121 (25) weaker than the
lattice's bound; on the U-Net, whose long skips leave no separator above the budget, nothing.
``benchmarks/results/cpu/milp_gaps/separators/``. Checked ad hoc against the brute force on
1,183 (graph, budget) cases of DAGs of 5-7 nodes (with and without a chain through them, views,
first gradients that are views, outputs held to the step's end): never above the optimum, positive
on 115; the same with separators defined without the edge rule had passed 3,236 cases of other
DAGs before the test above found its one counterexample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...cost.simulator import step_levels
from ...graph import Graph
from .highs import Builder, load_highspy, run

__all__ = ["CutBound", "cut_bound", "separators", "separator_floor", "MAX_CUTS", "SCALE_S", "CUTS_BASIS"]

CUTS_BASIS = "separators"
"""``milp_bound_basis`` of a bound this module proved (relative to the simulator, as the program's)."""

MAX_CUTS = 48
"""At most this many separators enter the program (those with the highest unpatched level)."""

SCALE_S = 1e9
"""Objective units per second (HiGHS works on nanoseconds: node times near 1e-8 s are below its tolerances)."""


@dataclass
class CutBound:
    """``bound_s``: a proven lower bound of the least extra time within the budget (``inf``: no
    plan fits); ``cuts``: the separators used; ``status``: HiGHS's (``"optimal"``, ``"time_limit"``,
    ``"infeasible"``), or ``"infeasible"`` when a separator's level is over the budget before any
    storage is held, or ``"no separator above the budget"`` (bound 0)."""

    bound_s: float
    cuts: list[int]
    status: str
    seconds: float = 0.0


def separators(graph: Graph) -> list[int]:
    """The nodes every plan reaches at the same moment of backward, with only their own gradient
    pending (module docstring): every node before is an ancestor, every node after a descendant, and
    no edge goes from before to after."""
    n = len(graph)
    below = [0] * n  # the ancestors of each node, a bitset
    for v in range(n):
        for u in graph.pred(v):
            below[v] |= below[u] | 1 << u
    above = [0] * n  # the descendants
    for v in range(n - 1, -1, -1):
        for w in graph.succ(v):
            above[v] |= above[w] | 1 << w
    far, jumped = -1, []  # the latest reader of a node before c: an edge from before c to after it
    for c in range(n):
        jumped.append(far > c)
        far = max(far, *graph.succ(c), c)
    return [c for c in range(n) if below[c].bit_count() == c and above[c].bit_count() == n - 1 - c
            and not jumped[c]]


def cut_bound(graph: Graph, budget: int, time_limit_s: float, *, threads: int | None = None) -> CutBound:
    """The bound of the module docstring at ``budget`` bytes, within ``time_limit_s`` of HiGHS."""
    sites = _Sites(graph)
    touch = sites.levels.bwd_touch
    above = [c for c in separators(graph) if touch[c] is not None and touch[c] > budget]
    chosen = sorted(sorted(above, key=lambda c: -touch[c])[:MAX_CUTS])
    if not chosen:
        return CutBound(0.0, [], "no separator above the budget")
    prog = _Program(sites, budget)
    for c in chosen:
        if not prog.add_cut(c):
            return CutBound(math.inf, chosen, "infeasible")
    hs = load_highspy()
    h = prog.b.build(hs, threads)
    res = run(h, hs, time_limit_s)
    if res.status == "infeasible":
        return CutBound(math.inf, chosen, res.status, res.seconds)
    dual = h.getInfo().mip_dual_bound
    bound = max(0.0, float(dual)) / SCALE_S * (1 - 1e-6) if np.isfinite(dual) else 0.0
    return CutBound(bound, chosen, res.status, res.seconds)


class _Sites:
    """What every plan holds at each separator's backward and what it may drop there (module docstring)."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.levels = step_levels(graph)
        n = len(graph)
        self.nd = [graph.nx.nodes[v] for v in range(n)]
        self.root = [graph.root(v) for v in range(n)]
        self.held_to_end = {self.root[v] for v in graph.held_to_end()}
        self.backward = [t is not None for t in self.levels.bwd_touch]  # a gradient reaches the node

    def at(self, c: int) -> tuple[set[int], list[tuple[int, int]], list[int], int]:
        """``(fixed, pairs, extras, base)`` at separator ``c``: the storages present in every plan, the
        ``(saver, saved)`` pairs and the nodes with saved extras a plan may drop, and ``base_c``."""
        nd, root, backward = self.nd, self.root, self.backward
        # present in every plan: what c saves, what the returned object holds to the end, and the
        # storages of c and later nodes (a view of an earlier storage is not one: that one may go)
        fixed = {root[x] for x in nd[c]["saves"]} | self.held_to_end | {root[v] for v in range(c, len(nd))
                                                                         if root[v] >= c}
        pairs = [(u, x) for u in range(c) if backward[u] for x in nd[u]["saves"] if root[x] not in fixed]
        extras = [u for u in range(c) if backward[u] and nd[u]["extra_saved_bytes"]]
        # what a plan might not hold at c: everything nodes before c save or hold for autograd (those
        # no gradient reaches included, though they constrain nothing); taking out more only lowers base
        droppable = {root[x] for u in range(c) for x in (*nd[u]["saves"], *nd[u]["unreached_saves"])} - fixed
        base = self.levels.bwd_touch[c] - sum(nd[s]["alloc_bytes"] for s in droppable) \
            - sum(nd[u]["extra_saved_bytes"] for u in range(c))
        return fixed, pairs, extras, base


def separator_floor(graph: Graph) -> int:
    """A lower bound of every plan's step peak: the largest ``base_c`` (what every plan holds at a
    separator's backward; 0 without separators). Inception-v3 at CPU size: 1,474,944 bytes at its
    first node's backward, all but its first convolution's parameter gradients allocated (50 % of its
    unpatched peak is 1,452,984)."""
    sites = _Sites(graph)
    return max((sites.at(c)[3] for c in separators(graph) if sites.backward[c]), default=0)


class _Program:
    """The rows of :func:`cut_bound`, one separator at a time (variables as in the module docstring)."""

    def __init__(self, sites: _Sites, budget: int) -> None:
        self.sites, self.budget = sites, budget
        self.b = Builder()
        self.r = [self.b.var(d["time_s"] * SCALE_S) for d in sites.nd]
        self.prev: dict[int, int] | None = None  # a[., c] of the previous separator

    def add_cut(self, c: int) -> bool:
        """The rows of separator ``c``; ``False`` when nothing fits there at all."""
        nd, root, backward, b = self.sites.nd, self.sites.root, self.sites.backward, self.b
        fixed, pairs, extras, base = self.sites.at(c)
        cap = self.budget - base
        if cap < 0:
            return False
        a = {v: b.var() for v in range(c)}
        p = {v: b.var(ub=1.0 if nd[v]["recomputable"] else 0.0) for v in range(c)}
        held = {s: b.var() for s in {root[v] for v in range(c)} - fixed}
        kept_extra = {u: b.var() for u in extras}
        for v in range(c):
            b.row({a[v]: 1, self.r[v]: -1}, -math.inf, 0)  # runs in a replay: paid once
            b.row({a[v]: 1, p[v]: -1}, -math.inf, 0)  # runs in a replay: its segment is replayed
            for x in self.sites.g.pred(v):  # its inputs: run before it in the replay, or held
                if root[x] not in fixed:
                    b.row({held[root[x]]: 1, a[x]: 1, a[v]: -1}, 0, math.inf)
        for v, prev in (self.prev or {}).items():  # absent on an interval of moments from the backward's start
            b.row({prev: 1, a[v]: -1}, -math.inf, 0)
        for u, x in pairs:
            b.row({held[root[x]]: 1, a[x]: 1}, 1, math.inf)  # held, or made again
            b.row({held[root[x]]: 1, p[u]: 1}, 1, math.inf)  # held, or its saver is in a replay to come
        for u in range(c):
            if backward[u] and (nd[u]["extra_saved_bytes"] or u in nd[u]["saves"]):
                b.row({p[u]: 1, a[u]: -1}, -math.inf, 0)  # what it saves of its own: it runs
        for u in extras:
            b.row({kept_extra[u]: 1, p[u]: 1}, 1, math.inf)
        mem = {held[s]: nd[s]["alloc_bytes"] / self.budget for s in held}
        mem.update({kept_extra[u]: nd[u]["extra_saved_bytes"] / self.budget for u in extras})
        b.row(mem, -math.inf, cap / self.budget)
        self.prev = a
        return True
