"""``auto``'s chain search: the lattice search (:mod:`.lattice`) over the prefixes of one order.

Why (issue 28, ``benchmarks/results/cpu/auto_gaps/ANALYSIS.md``): on ResNet-50 at CPU size
``auto``'s plan (``dp-approx``'s) recomputed 1.18-1.56x the proven optimum. The optimum is not of
another kind: it recomputes the middle of each bottleneck block (conv2 .. bn3) and keeps the
add, its ReLU and the next conv1 .. relu1 plain, ~25 short segments alternating recomputed and
plain, and a plan of the same extra time (0.2 % more at the least budget) has every segment a
contiguous range of node ids. ``dp-approx`` recomputes every segment but the last (no plain
segment between recomputed ones) and the polish (:mod:`..polish`) only moves boundaries: neither
reaches a plan of 25 segments with free flags. The full lattice finds it but closes in 3-12 s
there, and ``auto`` asks it only below 120 nodes.

:func:`chain_improve` searches the exact model's steps (:mod:`autoremat.cost.segment_replay`, as
the lattice search) on a *chain* of lower sets: the prefixes of a topological order ``π`` (every
prefix of a topological order is a lower set), so the family has ``n + 1`` sets whatever the
graph's width, every segment is a range of ``π`` and its flag is free. ``π`` is the order of
``auto``'s own plan (:func:`..polish.plan_order`), so that plan's boundaries are prefixes too
(node order where no plan fits). On ResNet-50 the exact search over this chain (A*, the lattice's
``least_time``) reaches the optimum (0.2 % above it at the least budget) but takes 2-5 s and on
random U-Nets of 170-250 nodes did not close in 30 s, so ``auto`` runs a bounded heuristic
instead, :func:`beam`: the sets in chain order, :data:`CHAIN_WIDTH` labels kept per set,
dominance within :data:`CHAIN_SLACK`, and a second beam that also keeps the labels holding the
fewest bytes; the better plan of the two is taken. (The second was first run only where the first
found nothing, the random U-Nets' case; on the U-Nets where the first found a plan the second's
was 13-22 % better: at Chen's least budget 1.275 -> 1.000, 1.151 -> 1.006 and 1.108 -> 0.91 times
the best plan known, on ResNet-50 and the other families within 1 % of the first's either way.)
Its work does not depend on a clock:
the same graph and budget give the same plan on any machine, at any load. The beams' cost-to-go
``h`` has the exact model's needs up to :data:`CHAIN_FULL_NODES` nodes (:data:`CHAIN_EXACT_NEEDS`):
the beam keeps the labels by ``t + h``, and with the lower bounds' needs alone ``h`` let it keep
labels whose continuations do not fit (PSPNet at 50 %: 1.149x the optimum with those, 1.008x).

One order's prefixes cannot run one branch of a fork first in one place and the other elsewhere;
where no plan recomputing only is known and the beams find none, a work-bounded exact search over
the prefixes of two orders (this chain's and :func:`latest_order`'s) does (:data:`CHAIN_RESCUE_WORK`);
the least-peak path over those lower sets counts in ``auto``'s least budget (:func:`chain_least_peak`).

The steps price a recomputed segment's replay up to its tail, as the plan will run
(:attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`; :mod:`.exact` says why and what
it gains). The plan found is simulated with its tails (:func:`.search.judge`) and returned only
where it fits the budget and recomputes less than the plan to beat; the caller finalises it
(replay tails, the budget check) and keeps its own plan otherwise. Graphs of at most
:data:`CHAIN_MAX_NODES` nodes, every step up to :data:`CHAIN_FULL_NODES` and steps of at most
:data:`CHAIN_WINDOW` prefixes above it (:class:`WindowedChain`); ``auto`` does not ask it for
measured captures (``solvers._chain_for_auto`` says why).

Complexity: per beam, at most ``width`` labels expanded per set, each over its ``O(n)`` steps
(``2 n`` with the flags), ``O(width n²)`` labels made and one replay (``O(segment)``) per label
kept; ``h`` (:class:`.cost_to_go.CostToGo`) over the ``n + 1`` sets and ``O(n²)`` steps, at most
one replay per step for its exact needs; the rescue over at most ``2 n + 1`` sets. Windowed:
``O(w)`` steps per set, ``O(width n w)`` labels, replays of ``O(w)`` nodes, ``h`` over ``O(n w)`` steps.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Iterator
from heapq import heapify, heappop, heappush

from ...cost.bitsets import GraphBits
from ...graph import Graph
from ...plan import Plan
from ..content_keys import memory_signature
from ..polish import plan_order
from .cost_to_go import CostToGo
from .lattice import Lattice, add_label, dominated
from .search import judge, path_plan

__all__ = ["CHAIN_MAX_NODES", "CHAIN_FULL_NODES", "CHAIN_WINDOW", "WindowedChain", "CHAIN_WIDTH", "CHAIN_RESCUE_WIDTH",
           "CHAIN_GRID", "CHAIN_EXACT_NEEDS", "CHAIN_RESCUE_WORK", "RESCUE_EXACT_SETS", "beam", "CHAIN_SLACK",
           "chain_improve", "chain_least_peak", "latest_order", "CHAIN_SHARED_NEEDS", "clear_shared_needs"]

logger = logging.getLogger("autoremat.solvers.milp")

CHAIN_MAX_NODES = 1000
""":func:`chain_improve` leaves larger graphs alone."""

CHAIN_FULL_NODES = 300
"""Up to this many nodes every step of the chain is searched (``O(n²)`` steps, segments of any
length); above it a step spans at most :data:`CHAIN_WINDOW` prefixes (:class:`WindowedChain`)."""

CHAIN_WINDOW = 32
"""The most nodes a segment of the chain search spans on graphs above :data:`CHAIN_FULL_NODES`:
``O(n w)`` steps, each replayed over at most ``w`` nodes, so the work grows linearly in ``n``
(without it, on Inception-v3, 314 nodes, 84 % of the search's 20-26 s were replays of long
segments). Measured (x86_64, 2 cores, CPU only, shared; ``benchmarks/results/cpu/auto_gaps/``
ANALYSIS.md section 7), over the best plan ``milp`` knows: on Inception-v3 windows of 16-64 gave
0.586-0.620x at the least budget, 0.85-0.86x at 75 % and 0.892-0.898x at Chen's least (the full
search 0.593x, 0.850x, 0.900x); on DenseNet-121 at 75 % 32 and 64 found 0.979x (the full search
0.956x), 16 and 24 nothing below ``blocks``' 1.076x; 32 took 0.5-0.7x the time of 64 there."""

CHAIN_WIDTH = 8
"""Labels :func:`beam` keeps per set. Measured (x86_64, 2 cores, loaded) on random 173-245-node
networks at 50 %: width 16 took 1.3-2.4x as long as 8 for plans within 0-1.3 % of width 8's;
on ResNet-50 width 8 and 16 gave plans within 1 % of each other."""

CHAIN_RESCUE_WIDTH = 16
"""Where no plan fits (``auto`` has none to beat) and neither beam of :data:`CHAIN_WIDTH` finds
one, the beam that also keeps the fewest bytes runs once more with this width. Measured (issue 28,
``benchmarks/results/cpu/optimum_gaps/tight/ANALYSIS.md``): on a random 173-node U-Net at
``milp``'s least budget, where every other solver's least budget is 14 % higher, widths 8 found
nothing and 16 a plan recomputing 0.994x ``milp``'s (1.4 s; 32: the same plan in 3.6 s). 0 turns it off."""

CHAIN_GRID = 1024
"""Grid points of ``h``'s kept bytes (:class:`.cost_to_go.CostToGo`; 8192 for the exact search:
1.3 s of a random 245-node U-Net's 6 s at 50 %)."""

CHAIN_SLACK = 0.01
"""Dominance slack, as a fraction of the budget (kept bytes) and of the plan to beat (time)."""

CHAIN_EXACT_NEEDS = True
"""Whether :func:`beam`'s ``h`` on a chain of at most :data:`CHAIN_FULL_NODES` nodes prices every
step a row's least may come from with the exact model's need (:class:`.cost_to_go.CostToGo` with
its exact pass run to the end: no clock, the same table at any load); else with the lower bounds
only (as above :data:`CHAIN_FULL_NODES`, and on module-level graphs whose blocks were captured op by
op: on the seven graphs of :mod:`autoremat.zoo.hf` at 50 % and 75 % the plans were the same either
way and the exact needs cost up to 0.6 s a solve). Measured (issue 28, x86_64, 2 cores, CPU only, shared;
``benchmarks/results/cpu/auto_gaps/session25/``): at 50 % ``auto``'s plan recomputed 1.149x ->
1.008x the proven optimum on PSPNet, 1.003x -> 1.000x on ResNet-50 and 1.129e-6 -> 1.009e-6 s on
GoogLeNet (milp's 60 s plan: 1.129e-6), the root ``h`` of ResNet-50 rising from 1.19e-6 to 1.47e-6
s (optimum 1.49e-6); the exact needs cost one replay per step refined (6,443 on ResNet-50): in
alternating runs ``auto`` took +0.9 s on ResNet-50 (+17 %) and +3.4-4.3 s on GoogLeNet (+70-85 %),
about as long on PSPNet. Capping the refinements (500-3,000) kept PSPNet's gain, not GoogLeNet's."""

CHAIN_RESCUE_WORK = 1_000_000
"""Where no plan recomputing only is known (``auto``'s solvers found none, or only plans that
offload) and the chain's beams find none, :func:`chain_improve` runs the exact search
(:meth:`.Lattice.least_time`, A*) with this much work (:data:`.exact.AUTO_WORK`'s units, ~1.2 s
of CPU) over the prefixes of two orders: the chain's and :func:`latest_order`'s, so that a path
may run one branch of a fork first in one place and the other elsewhere (the lower sets of both,
ordered by size; graphs of at most :data:`CHAIN_FULL_NODES` nodes). Measured (issue 28): on PSPNet
at CPU size, at ``milp``'s proven least budget (1,039,124 B), no solver of ``auto`` and no beam
over one order found a plan recomputing only (``auto`` returned ``combined``'s offload plan,
1.221x the optimum's time); the optimum runs the main branch of two of the four residual blocks
with a downsample shortcut before that shortcut (:func:`latest_order`'s way) and the other two
as captured, and the search over both orders finds a plan within 1 % of it (0.65 M units). The
beams over the two orders found nothing there and took 4x the A*'s time on a 277-node U-Net, so
they are not run. 0 turns the rescue off."""

RESCUE_EXACT_SETS = 1.5
"""The rescue's ``h`` has exact needs (:data:`CHAIN_EXACT_NEEDS`) only where its lower sets number at
most this many times a chain's (``n + 1``): their cost grows with the steps, the square of the sets.
Measured (x86_64, CPU-size zoo): PSPNet's 261 sets for 205 nodes (1.27x) need them (with the bounds'
needs alone the A* did not close in 2 M units at its least budget); on GoogLeNet's 360 for 197
(1.83x) they took ~20 s of a 24 s solve at its least budget, where the least-peak plan
(:func:`chain_least_peak`), polished, is the answer."""

_chains: weakref.WeakKeyDictionary[Graph, tuple[tuple[tuple[int, ...], int | None, bool], Lattice]] = \
    weakref.WeakKeyDictionary()
_bounds: weakref.WeakKeyDictionary[Lattice, dict[int, CostToGo]] = weakref.WeakKeyDictionary()
_op_blocks: weakref.WeakSet[Lattice] = weakref.WeakSet()  # of module-level graphs with blocks captured op by op
_least: weakref.WeakKeyDictionary[Graph, tuple[int, Plan] | None] = weakref.WeakKeyDictionary()

CHAIN_SHARED_NEEDS = 4
"""Chains whose exact needs (:attr:`.Lattice.needs`, :attr:`.Lattice.tight`: bytes, no times) are
kept per process by the graph's bytes and structure (:func:`..content_keys.memory_signature`) and
the chain's order, least recently used out first: a graph of the same bytes and other times meets
them instead of replaying every step again. That is each new capture of a model whose stable plan's
stand-in (:func:`..stable.reference_graph`) has another per-node cost, its measured mean rounded to
another power of two (the captures of a loaded machine; the memo of reference plans is by content,
times included, so those solve again). Measured (x86_64, 2 cores, CPU only, shared; two runs
alternating with the code before): ``solve(auto, 50%)`` of the second of two stand-ins of a CPU-size
capture, at costs ``t`` and ``2 t``, took 2.1-2.3 s instead of 3.2-3.3 s on ResNet-50, 3.4-3.5 s
instead of 4.7-4.8 s on GoogLeNet, 2.2 s instead of 2.3-2.6 s on PSPNet, with the same plans. The
searches count their work per check whether a need is cached or not, so their answers do not
depend on it."""


class WindowedChain(Lattice):
    """A chain of prefixes whose steps span at most ``window`` of them: from set ``i`` only to
    ``i + 1 .. i + window``. The prefixes of a chain are nested and their keys (the bytes a
    segment keeps, :class:`~autoremat.cost.backward_floor.TransitionBounds`) grow with the index,
    so these are in key order, as :meth:`.Lattice.successors` gives them; every other method is
    the lattice's, and the cost-to-go and the beam see only these steps. The list is filled on
    the first call (from :meth:`.Lattice.moves_of`, which prices what a call adds to it)."""

    def __init__(self, p: GraphBits, family: list[int], window: int) -> None:
        super().__init__(p, family)
        self.window = window

    def successors(self, i: int, limit: int) -> list[int]:
        lst = self.succ[i]
        if not lst and i < self.last:
            lst.extend(range(i + 1, min(i + self.window, self.last) + 1))
        return lst


def _lattice(graph: Graph, order: tuple[int, ...], latest: bool = False) -> Lattice:
    """The chain of ``order``'s prefixes as a lattice, windowed above :data:`CHAIN_FULL_NODES`
    nodes (the last one per graph kept: ``auto`` solves one graph at several budgets, and one
    order serves them while its plan does; a new order's lattice takes over the last one's
    :class:`GraphBits` and segment replays, which are keyed by the segment's bitsets, not by the
    family: at other budgets about half the replays were of segments replayed before; its exact
    needs are those kept for the graph's bytes and the family, :data:`CHAIN_SHARED_NEEDS`). ``latest``:
    the prefixes of :func:`latest_order` too, every set ordered by size (:data:`CHAIN_RESCUE_WORK`)."""
    window = CHAIN_WINDOW if len(order) > CHAIN_FULL_NODES else None
    got = _chains.get(graph)
    if got is not None and got[0] == (order, window, latest):
        return got[1]
    family = _prefixes(order)
    if latest:
        family = sorted(set(family).union(_prefixes(latest_order(graph))), key=lambda s: (s.bit_count(), s))
    p = GraphBits(graph, tails=True) if got is None else got[1].p
    lat = Lattice(p, family) if window is None else WindowedChain(p, family, window)
    if got is not None:
        lat.replays = got[1].replays
    lat.needs, lat.tight = _shared_needs(memory_signature(graph), tuple(family))
    if graph.ops_blocks:
        _op_blocks.add(lat)
    _chains[graph] = ((order, window, latest), lat)
    return lat


@functools.lru_cache(maxsize=CHAIN_SHARED_NEEDS)
def _shared_needs(signature: int, family: tuple[int, ...]) -> tuple[dict, dict]:
    """The needs and tight bounds kept for a graph's bytes (its :func:`..content_keys.memory_signature`)
    and the lower sets ``family`` (their keys index it; :data:`CHAIN_SHARED_NEEDS`)."""
    return {}, {}


def clear_shared_needs() -> None:
    """Forget the exact needs kept by content (:data:`CHAIN_SHARED_NEEDS`): for a program that changes
    the cost model's module constants between solves (the tests)."""
    _shared_needs.cache_clear()


def _prefixes(order: tuple[int, ...]) -> list[int]:
    """The prefixes of ``order`` as bitsets, the empty one first."""
    family, acc = [0], 0
    for v in order:
        acc |= 1 << v
        family.append(acc)
    return family


def latest_order(graph: Graph) -> tuple[int, ...]:
    """A topological order that runs every node as late as its consumers allow: built from the end,
    each time taking, of the nodes whose consumers are all placed, the one of least id."""
    left = [len(graph.succ(v)) for v in graph.nodes]
    ready = [v for v in graph.nodes if not left[v]]
    heapify(ready)
    out: list[int] = []
    while ready:
        v = heappop(ready)
        out.append(v)
        for u in graph.pred(v):
            left[u] -= 1
            if not left[u]:
                heappush(ready, u)
    return tuple(reversed(out))


def beam(lat: Lattice, budget: int, incumbent: float, width: int, slack: tuple[int, float], spread: bool = False
         ) -> tuple[list[int], list[bool], float] | None:
    """The least extra time found by a beam search over a chain lattice (sets in chain order:
    every step goes to a later set), ``(sets, flags, model time)``, or ``None``.

    The sets are taken in order; at each, its waiting labels ``(t, m, dangling roots)`` are
    sorted by ``t + h`` (:class:`.cost_to_go.CostToGo`), checked (the exact model's need of the
    step that made them, as the lattice search does when it takes a label) and the first
    ``width`` that no kept label dominates (within ``slack``) are kept and expanded (``spread``:
    taken in turn from that order and from the fewest kept bytes up, :func:`_alternate`); labels
    that cannot beat ``incumbent`` (by ``t + h``) are never made. Every set is visited once, so
    the work is at most ``width`` expansions per set: bounded where the A* search is not (on
    random U-Nets it did not close in 30 s). Deterministic (ties broken by time, bytes, order
    made). Long by design: one loop over the sets with its tables in locals."""
    ctg = _cost_to_go(lat, budget)
    if ctg.table is None or ctg.table.item(0, 0) >= incumbent:
        return None
    table, unit, last = ctg.table, ctg.unit, lat.last
    labels: list[tuple] = [(0.0, 0, 0, 0, -1, None, False)]  # (t, m, set, dangling, parent, check, flag)
    waiting: list[list[tuple[float, float, int, int]]] = [[] for _ in lat.fam]  # (t + h, t, m, label)
    waiting[0].append((0.0, 0.0, 0, 0))
    sm, st = slack
    for j in range(last + 1):
        if not waiting[j]:
            continue
        order = (_alternate(sorted(waiting[j]), sorted(waiting[j], key=_by_bytes)) if spread and j != last
                 else (e[3] for e in sorted(waiting[j])))  # at the last set: the least time that fits
        waiting[j] = []
        fronts: dict[int, tuple[list[int], list[float]]] = {}
        kept = 0
        for lid in order:
            t, m, _, dang, parent, check, flag = labels[lid]
            seen = fronts.get(dang)
            if seen is not None and dominated(seen, m + sm, t + st):
                continue
            if check is not None:
                i, room = check
                if lat.need(i, j, labels[parent][3], flag, room) > room:
                    continue
            if j == last:
                seq, flags = lat.path(labels, lid)
                return seq, flags, t
            if seen is None:
                fronts[dang] = ([m], [t])
            else:
                add_label(seen, m, t)
            room = budget - m
            for k, fl, t2, m2, dang2 in lat.children(j, t, m, dang, room, incumbent):
                f2 = t2 if k == last else t2 + table.item(k, m2 // unit)
                if f2 >= incumbent:
                    continue
                waiting[k].append((f2, t2, m2, len(labels)))
                labels.append((t2, m2, k, dang2, lid, (j, room), fl))
            kept += 1
            if kept >= width:
                break
    return None


def _by_bytes(entry: tuple[float, float, int, int]) -> tuple[int, float, int]:
    return entry[2], entry[0], entry[3]


def _alternate(by_time: list[tuple], by_bytes: list[tuple]) -> Iterator[int]:
    """Label ids from the two orders in turn, each once: the beam keeps the labels closest to
    the least time and those keeping the fewest bytes (on random U-Nets a beam of the first
    only ran out of memory room at the long skips' ends and found no plan at widths 8-16)."""
    seen: set[int] = set()
    for a, b in zip(by_time, by_bytes):
        for lid in (a[3], b[3]):
            if lid not in seen:
                seen.add(lid)
                yield lid


def _cost_to_go(lat: Lattice, budget: int) -> CostToGo:
    """``h`` for :func:`beam` on a grid of :data:`CHAIN_GRID` points (kept per lattice and budget),
    with exact needs below a window (:data:`CHAIN_EXACT_NEEDS`, :data:`RESCUE_EXACT_SETS`)."""
    mine = _bounds.setdefault(lat, {})
    got = mine.get(budget)
    if got is None:
        exact = (CHAIN_EXACT_NEEDS and not isinstance(lat, WindowedChain) and lat not in _op_blocks
                 and len(lat.fam) <= RESCUE_EXACT_SETS * (lat.p.n + 1))
        got = mine[budget] = CostToGo(lat, budget, grid=CHAIN_GRID, exact_until=math.inf if exact else -math.inf)
    return got


def chain_improve(graph: Graph, plan: Plan | None, budget: int, extra_s: float) -> Plan | None:
    """A plan over the prefixes of ``plan``'s order (module docstring) that the simulator puts
    within ``budget`` and below ``extra_s`` seconds of extra time (``math.inf``: any plan that
    fits), or ``None`` (too large a graph, or no search found anything cheaper; logged at DEBUG).
    Where ``plan`` recomputes only and neither beam beats it, that is all; where no plan
    recomputing only is known (``plan`` is ``None`` or offloads) and none is found, the rescue
    runs over two orders (:data:`CHAIN_RESCUE_WORK`; not on a module-level graph whose blocks were
    captured op by op, where ``auto`` does not search the lattice either). The plan returned is
    bare: the caller finalises it."""
    n = len(graph)
    if n > CHAIN_MAX_NODES or extra_s <= 0:
        return None
    order = (None if plan is None else plan_order(graph, plan)) or tuple(range(n))
    found = _beams(graph, _lattice(graph, order), budget, extra_s, extra_s == math.inf)
    if found is None and (plan is None or plan.offloads) and _rescues(graph):
        found = _exact(graph, _lattice(graph, order, latest=True), budget, extra_s)
        least = chain_least_peak(graph) if found is None else None
        if least is not None and least[0] <= budget:  # what least_budget(graph, "auto") promised
            found, _ = _judged(graph, Plan(list(least[1].segments), solver="milp"), budget, None,
                               extra_s * (1 - 1e-9))
    if found is None:
        logger.debug("milp (chain, for auto): no plan below %.6g s", extra_s)
        return None
    found.options["auto_stage"] = "chain"
    return found


def _rescues(graph: Graph) -> bool:
    """Whether :data:`CHAIN_RESCUE_WORK`'s search runs on ``graph``: at most :data:`CHAIN_FULL_NODES`
    nodes, not a module-level graph whose blocks were captured op by op (as ``auto``'s lattice:
    see :func:`.exact._auto_lattice`)."""
    return len(graph) <= CHAIN_FULL_NODES and CHAIN_RESCUE_WORK > 0 and not graph.ops_blocks


def chain_least_peak(graph: Graph) -> tuple[int, Plan] | None:
    """``(simulated peak, plan)`` of the least-peak path over the rescue's lower sets (the prefixes
    of node order and of :func:`latest_order`; :meth:`.Lattice.least_peak` with
    :data:`CHAIN_RESCUE_WORK`), where the rescue runs and the search closes; else ``None``. Cached
    per graph: ``least_budget(graph, "auto")`` counts it and :func:`chain_improve` falls back on
    its plan, so ``auto`` finds a plan at every budget at or above it. Measured (x86_64, CPU-size
    zoo on the meta device): GoogLeNet 862,032 B, 5.7 % below ``auto``'s least budget without it
    (913,871 B) and below ``milp``'s 60 s least-peak search (906,576 B), in 0.55 M units (1.9 s);
    ResNet-50 and PSPNet reach their proven recompute-only least budgets (0.14 M, 0.71 M units)."""
    if graph in _least:
        return _least[graph]
    got = None
    if _rescues(graph):
        ans = _lattice(graph, tuple(range(len(graph))), latest=True).least_peak(work=CHAIN_RESCUE_WORK)
        if ans.seq is not None:
            plan = path_plan(ans.seq, ans.flags)
            got = (judge(graph, plan)[0], plan)
        logger.debug("milp (chain, for auto): least peak %s after %.0f work units", ans.status, ans.work)
    _least[graph] = got
    return got


def _beams(graph: Graph, lat: Lattice, budget: int, extra_s: float, wide: bool) -> Plan | None:
    """The best plan :func:`beam` finds on ``lat`` below ``extra_s`` (both beams; ``wide``: a
    wider one where they find nothing), simulated within ``budget``; or ``None``."""
    slack = (int(CHAIN_SLACK * budget), 0.0 if extra_s == math.inf else CHAIN_SLACK * extra_s)
    found, best = None, extra_s * (1 - 1e-9)
    tries = [(False, CHAIN_WIDTH), (True, CHAIN_WIDTH)] + [(True, CHAIN_RESCUE_WIDTH)] * (
        wide and CHAIN_RESCUE_WIDTH > 0)
    for spread, width in tries:
        if found is not None and width != CHAIN_WIDTH:
            break  # the wider beam only where nothing fits yet
        got = beam(lat, budget, best, width, slack, spread)
        if got is not None:
            found, best = _judged(graph, path_plan(got[0], got[1]), budget, found, best)
    return found


def _exact(graph: Graph, lat: Lattice, budget: int, extra_s: float) -> Plan | None:
    """The exact search's plan on ``lat`` (:meth:`.Lattice.least_time` with :data:`CHAIN_RESCUE_WORK`
    and :func:`beam`'s ``h``) below ``extra_s``, simulated within ``budget``; or ``None``."""
    ans = lat.least_time(budget, incumbent=extra_s * (1 - 1e-9), work=CHAIN_RESCUE_WORK, ctg=_cost_to_go(lat, budget))
    logger.debug("milp (chain, for auto): exact search %s after %d labels, %.0f work units", ans.status, ans.labels,
                 ans.work)
    return None if ans.seq is None else _judged(graph, path_plan(ans.seq, ans.flags), budget, None,
                                                extra_s * (1 - 1e-9))[0]


def _judged(graph: Graph, plan: Plan, budget: int, found: Plan | None, best: float) -> tuple[Plan | None, float]:
    """``(plan, its extra time)`` where ``plan`` simulates within ``budget`` below ``best``; else
    ``(found, best)`` unchanged."""
    peak, extra = judge(graph, plan, tails=True)
    if peak <= budget and extra < best:
        return plan, extra
    logger.debug("milp (chain, for auto): a plan found simulates at %d bytes, extra %.6g s (budget %d, to beat "
                 "%.6g s); not taken", peak, extra, budget, best)
    return found, best
