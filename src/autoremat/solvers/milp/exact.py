"""``milp``'s first stage: the lattice search (:mod:`.lattice`) where the graph has few lower sets.

Where a graph has at most :data:`MAX_LOWER_SETS` lower sets, ``milp`` (with ``k`` left at
``None``) first runs the exact label-setting (A*) search over every canonical strategy with free
flags (no limit on the number of segments, so ``k`` is the node count); the HiGHS program of
:mod:`.search` then gets the time left, only when the lattice did not close.

* The plan the lattice returns is simulated (:func:`.search.judge`, replay tails in). When it
  fits, it is returned with its simulated extra time and the lattice's optimum as the bound
  (``basis="exact model"``); when it does not (the exact model's two documented exceptions, or
  a replay tail raising the peak), the lattice's answer is dropped with a logged reason and the
  program searches alone (its bound is the simulator's relaxation, ``basis="program"``).
* The lattice's bound is proven *relative to the exact model*
  (:mod:`autoremat.cost.segment_replay`), which equals :func:`~autoremat.cost.simulate` on the
  seeded random DAGs of its tests and differs from it only where a boundary gradient arrives
  through a pass-through op or a recomputed segment views its input; the plan's summary and
  :class:`~autoremat.solvers.milp.Gap` say which basis a proof has.
* Time limit: the lattice gets :data:`LATTICE_SHARE` of ``time_limit_s`` (its A* bound,
  :class:`.cost_to_go.CostToGo`, up to :data:`CTG_SHARE` of that: the bounds first, exact needs in
  the time left, and zero at the sets its first pass did not reach in time); when it
  stops there, its bound (the next label's key) is kept beside the program's.

``auto`` at tight budgets (issue 28; decision by measurement, x86_64, 2 cores, shared, load 2-8,
``benchmarks/results/cpu/optimum_gaps/tight/ANALYSIS.md``): at ``milp``'s least budget ``auto``
had no plan on 20 of the 100 seeded random networks of ``benchmarks/optimum_gaps.py`` (13 chains
with skips, 6 U-Nets, 1 dense block; 151-297 nodes, past :data:`AUTO_MAX_NODES`). Its solvers stop
above that budget (chen, dp-approx and xla-greedy's least: 1.1 % above on the dense block, 6-23 %
on the others), and the chain search, which has only node order when no plan fits, found nothing.
Why: on the chains with skips ``milp``'s least budget is this lattice's least peak (its search
closes in 0.12-0.55 M work units on all 13) and no chain of node order reaches it (the exact least
peak over that chain: 2-7 % higher on the three measured); on a U-Net (173 nodes, the one checked)
the lattice's least-peak plan is a chain of node order that the beams of width 8 miss and a beam
of width 16 finds (the lattice search needs 8 M units there); the dense block needs 2.4 M units.
So ``auto`` asks, only where nothing else fits: the least-peak search on graphs of up to
:data:`AUTO_LEAST_MAX_NODES` nodes (:data:`AUTO_LEAST_WORK`), whose plan the chain search and the
polish then improve, and a wider chain beam (:data:`.chain.CHAIN_RESCUE_WIDTH`);
``least_budget(graph, "auto")`` counts the least-peak search. Neither needs ``highspy``. Calling
the HiGHS program instead was not taken: ``milp``'s least-budget search took 30-40 s on those
U-Nets (3 s asked; ``optimum_gaps/random_25/`` and ``random_26_100/``), so a few seconds of it in ``auto``
would not reach their budgets, and on the chains with skips it is this lattice search that does.

``auto``'s lattice prices a recomputed segment's replay up to its tail (``lattice_of(graph,
tails=True)``, :attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`) and judges its plan's
time with the tails, as ``solve``'s plan runs; ``milp``'s keeps the papers' whole replay, over
which its bounds are proven (the brute force and ``dp-exact`` price the same), unless asked for
the price as plans run (its ``tails`` option: then its lattice is the tails one too). So ``auto``'s plan
is optimal in the model of the plan as it runs (bytes of whole replays), and may recompute more
than ``milp``'s optimum in ``milp``'s model. Measured (x86_64, 2 cores, the seven zoo models on the
meta device at the least, 75 %, 50 % and Chen's least budgets, ``auto`` before and after, as its
plans run; ``benchmarks/results/cpu/auto_gaps/tails_paper/``): at the papers' size no plan slower,
U-Net 0.46-0.98x the extra time (24.45 -> 21.79 ms at the least budget), VGG19 0.41x and 0.44x
(Chen's least, 75 %), PSPNet 0.87-0.93x, ResNet-50 0.90-0.98x; at CPU size 0.88-1.00x. Of plans
that run alike the searches keep the one shorter replayed whole
(:data:`~autoremat.cost.segment_replay.TAIL_TIE`).

Complexity: enumerating the lower sets is O(sets × n) and stops at the limit; the search is
described in :mod:`.lattice`. A lattice is kept per graph (weakly; one per pricing) and reused across
budgets.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Iterable

from ...cost.bitsets import GraphBits
from ...graph import Graph
from ...plan import Plan
from ...replay_tail import takes_tails
from ..kusumoto.families import all_lower_sets
from .lattice import Lattice, LatticeAnswer
from .search import Outcome, best_fit, judge, path_plan

__all__ = ["MAX_LOWER_SETS", "LATTICE_SHARE", "CTG_SHARE", "AUTO_WORK", "AUTO_MAX_NODES", "AUTO_MAX_LOWER_SETS",
           "AUTO_LEAST_MAX_NODES", "AUTO_LEAST_WORK", "lattice_of", "TAILS_BASIS",
           "lattice_time", "lattice_peak", "auto_improve", "auto_least_peak"]

logger = logging.getLogger("autoremat.solvers.milp")

MAX_LOWER_SETS = 20000
"""The lattice search runs on graphs with at most this many lower sets (measured on 2 CPU cores:
ResNet-50's 240 close in 7-13 s at 50-75 %, PSPNet has 1545, GoogLeNet 8838 at CPU size)."""

LATTICE_SHARE = 0.75
"""The share of ``time_limit_s`` the lattice may use before the program gets the rest."""

CTG_SHARE = 0.85
"""The share of the lattice's time its cost-to-go (the A* bound) may use. Most of it: the bound
is mostly ``h`` at the empty set (PSPNet at CPU size, 50 %: ``h`` 1.33e-6 s, the A* 45 s later
1.37e-6 s; without ``h`` 2.3e-7 s), and on a cold lattice of 1545 sets ``h`` took 31 s at load 5
(x86_64, 2 cores), past the 27 s that 0.6 gave it."""

TAILS_BASIS = "exact model, replay tails"
"""``milp_bound_basis`` of ``auto``'s lattice plan on an fx graph: optimal in the exact model with
its replays priced up to their tails (:attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`)."""

_lattices: weakref.WeakKeyDictionary[Graph, dict[bool, Lattice | None]] = weakref.WeakKeyDictionary()


def lattice_of(graph: Graph, tails: bool = False) -> Lattice | None:
    """The graph's lattice, or ``None`` when it has more than :data:`MAX_LOWER_SETS` lower sets
    (cached). ``tails``: its recomputed steps priced as the plan runs them, with their replay tails
    (:attr:`GraphBits.tails <autoremat.cost.bitsets.GraphBits.tails>`; ``auto``'s), where ``milp``
    proves its bounds over whole replays; the two share their lower sets and exact needs (bytes)."""
    tails = tails and takes_tails(graph)  # (elsewhere both pricings are the same: one lattice)
    mine = _lattices.setdefault(graph, {})
    if tails in mine:
        return mine[tails]
    other = mine.get(not tails)
    p = GraphBits(graph, tails=tails)
    if (not tails) in mine:
        family = None if other is None else other.fam
    else:
        family = all_lower_sets(p, MAX_LOWER_SETS)
    lat = None if family is None else Lattice(p, family)
    if lat is None:
        logger.info("milp: more than %d lower sets; the program searches alone", MAX_LOWER_SETS)
    elif other is not None:  # bytes only: the same for both
        lat.needs, lat.tight = other.needs, other.tight
    mine[tails] = lat
    return lat


def _plan(ans: LatticeAnswer) -> Plan:
    assert ans.seq is not None and ans.flags is not None
    return path_plan(ans.seq, ans.flags)


def lattice_time(graph: Graph, budget: int, time_limit_s: float, seeds: Iterable[Plan],
                 tails: bool = False) -> Outcome | None:
    """The lattice's answer at ``budget`` as an :class:`~.search.Outcome` (``None`` without a
    lattice). ``status`` ``"optimal"`` (proven in the exact model), ``"infeasible"`` (no plan
    fits the model), ``"time_limit"`` (bound only; the best seed kept) or ``"rejected"`` (the
    model's optimum failed the simulator: the caller searches without the lattice). ``tails``:
    extra time as the plans run (:func:`lattice_of`'s ``tails``, :func:`.search.judge`'s), basis
    :data:`TAILS_BASIS` where the graph takes tails."""
    lat = lattice_of(graph, tails=tails)
    if lat is None:
        return None
    start = time.monotonic()
    best, cost = best_fit(graph, seeds, budget, tails=tails)
    share = LATTICE_SHARE * time_limit_s
    lat.cost_to_go(budget, start + CTG_SHARE * share)  # the A* bound (cached; partial when not in time)
    n = len(graph)
    ans = lat.least_time(budget, incumbent=cost * (1 - 1e-9) if best is not None else math.inf,
                         deadline=start + LATTICE_SHARE * time_limit_s)
    out = Outcome(best, None if best is None else cost, ans.bound, ans.status, k=n)
    out.basis = TAILS_BASIS if lat.p.tails else "exact model"
    out.seconds = time.monotonic() - start
    if ans.seq is not None:
        plan = _plan(ans)
        peak, extra = judge(graph, plan, tails=tails)
        if peak <= budget:
            out.plan, out.cost, out.bound = plan, extra, min(ans.bound, extra)
        else:
            logger.info("milp: the exact model's optimum simulates at %d bytes, over the budget %d "
                        "(model exception or replay tail); program alone", peak, budget)
            out.status, out.bound, out.basis = "rejected", -math.inf, "program"
    elif ans.status == "optimal" and best is not None:
        out.bound = cost  # the seed is the optimum: nothing cheaper fits the model
    logger.info("milp (lattice): %s in %.1f s, %d labels, %d replays", out.status, out.seconds, ans.labels,
                ans.replays)
    return out


def lattice_peak(graph: Graph, time_limit_s: float) -> Outcome | None:
    """The lattice's least peak as an :class:`~.search.Outcome` (``None`` without a lattice):
    ``"optimal"`` when the simulated peak of its plan equals the model's least peak, else
    ``"time_limit"`` with the model's bound (the plan kept as a seed for the program)."""
    lat = lattice_of(graph)
    if lat is None:
        return None
    start = time.monotonic()
    ans = lat.least_peak(deadline=start + LATTICE_SHARE * time_limit_s)
    out = Outcome(None, None, ans.bound, ans.status, k=len(graph))
    out.basis = "exact model"
    if ans.seq is not None:
        plan = _plan(ans)
        peak, _ = judge(graph, plan)
        out.plan, out.cost = plan, float(peak)
        if peak > ans.bound:
            logger.info("milp: the exact model's least peak %d simulates at %d bytes; program checks it",
                        int(ans.bound), peak)
            out.status, out.bound, out.basis = "time_limit", -math.inf, "program"
    out.seconds = time.monotonic() - start
    logger.info("milp (lattice, least budget): %s in %.1f s", out.status, out.seconds)
    return out


AUTO_WORK = 2_000_000
"""How much work ``solve(solver="auto")`` lets the lattice spend looking for a cheaper plan
(:func:`auto_improve`; as much again for the least-peak plan where no other solver fits,
:func:`auto_least_peak`), in the units of :data:`.lattice.CHECK_WORK` (labels, steps, checks,
cost-to-go steps). A count, not a clock: the same graph and budget give the same plan at any load
(with a 2 s deadline, 57-75-node networks got different plans run to run on a loaded machine).

Set by what it buys (x86_64, 2 cores, shared): calibrated first to what the 2 s deadline it
replaces allowed on an idle machine (``benchmarks/auto_work.py``, results in
``benchmarks/results/cpu/auto_work/``: in ``auto`` itself on the 31 seeded networks of at most 120
nodes of ``benchmarks/optimum_gaps.py`` at their stored budgets, the searches a 1.4 M limit stopped
took 1.44-2.48 s of CPU, median 1.96 s; 1.77 s at 1.3 M, 2.47 s at 1.6 M; on cold lattices a unit
costs more). At 1.4 M, 86 of those 92 rows came within 5 % of the best plan known (the old
deadline: 91 at low load); the misses need 1.5-2.2 M units to close. At 2.0 M: 92 of 92, the
median ``auto`` solve unchanged (0.57 s), the slowest 4.5 -> 6.8 s (``benchmarks/auto_repeat.py``,
1.4 M against 2.0 M side by side, each network solved twice, no two solves differing;
``benchmarks/results/cpu/auto_gaps/repeat_2M/``).

What the 2 s bought, measured on the seeded random networks of the benchmarks (x86_64, 2 cores, shared; 6 s per
search, 50 % and Chen's least budget): where the search closes on graphs of at most ~100 nodes
it does so in 0.2-1.4 s (49-node dense block 0.3-0.4 s, 97-node chain with skips 0.2-1.4 s); a
97-node dense block, a 75-node transformer at 50 % and every network of 137-277 nodes but one
did not close in 6 s (the exceptions: 3.4 s, 5.1 s); ResNet-50 at CPU size (175 nodes, 240
lower sets) closes in 2.6 s at its least budget, 9 s at Chen's least, 17 s at 50 %, 31 s at 75 %.
So a longer limit buys little and would cost every ``auto`` solve on such graphs."""

AUTO_MAX_NODES = 120
"""``auto`` asks the lattice only on graphs of at most this many nodes (and
:data:`AUTO_MAX_LOWER_SETS` lower sets), where it may close within :data:`AUTO_WORK` (it
often does below ~100 nodes, rarely above: see there). Large op-by-op captures (the 64-layer
GPT-2 of ``benchmarks/solver_speed.py``, 4,307 nodes) are left out at this test, before any work.

Its cheapest plans often reorder the forward with plain segments (a pool recomputed between
plain segments on the zoo U-Net). They were off (0) while the CPU measurement read them above
prediction: that was the live-storage counter, not the plan (a dispatch mode makes autograd sum
gradients out of place; :mod:`autoremat.measure`). Measured on the CPU-size U-Net at 70/75/85 %
(x86_64, 2 cores): ``auto`` picks the lattice's plan, measured peak = prediction + 8 B, 8x less
predicted extra time than ``dp-approx`` at 75 %. Set 0 to turn it off."""

AUTO_MAX_LOWER_SETS = 1000

AUTO_LEAST_MAX_NODES = 300
"""Where no other solver fits the budget (and for ``least_budget(graph, "auto")``), ``auto`` asks
the lattice's *least-peak* search (:func:`auto_least_peak`, with :data:`AUTO_LEAST_WORK` and at
most :data:`AUTO_MAX_LOWER_SETS` lower sets; not the time search) on graphs of up to this many
nodes, past :data:`AUTO_MAX_NODES`; its plan is then improved by the polish and the chain search.
Why (issue 28, ``benchmarks/results/cpu/optimum_gaps/tight/ANALYSIS.md``): at ``milp``'s least
budget ``auto`` had no plan on 20 of the 100 seeded random networks, 13 of them chains with skips
of 151-290 nodes, where this search closes in 0.12-0.55 M work units and reaches ``milp``'s least
budget (no chain of one order holds its plan: the chain search over node order got 2-7 % above).
Only asked where nothing else fits, so ``auto``'s plans at other budgets are unchanged; 0 for
:data:`AUTO_MAX_NODES` turns it off too."""

AUTO_LEAST_WORK = 600_000
"""The work (:data:`AUTO_WORK`'s units) of the least-peak search on graphs past
:data:`AUTO_MAX_NODES`. Set by what it buys (x86_64, 2 cores, load 2-6,
``benchmarks/results/cpu/optimum_gaps/tight/least_peak_work.txt``): the 13 chains with skips
above needed 0.12-0.55 M; every random U-Net of 123-281 nodes there did not close within 2.5 M,
the dense blocks and transformers of 125-297 nodes needed 0.3-2.4 M or more. Where it does not
close it costs ``auto`` (only where nothing else fits) and ``least_budget(graph, "auto")`` the
600 k units once per graph (cached): 6.6-9.2 s on a 173- and a 281-node U-Net and a 297-node
dense block at load 7 (three jobs on the 2 cores; the work is a count, not a clock)."""


_auto_least: weakref.WeakKeyDictionary[Graph, tuple[int, Plan] | None] = weakref.WeakKeyDictionary()


def _auto_lattice(graph: Graph, least: bool = False) -> Lattice | None:
    """The graph's lattice where ``auto`` may ask it (at most :data:`AUTO_MAX_NODES` nodes, or
    :data:`AUTO_LEAST_MAX_NODES` for the least-peak search (``least``), and
    :data:`AUTO_MAX_LOWER_SETS` lower sets), else ``None`` with the reason logged at DEBUG.

    Not on a module-level graph whose repeated blocks were captured op by op (``capture``'s
    ``blocks="auto"`` on transformers): the lattice plans single nodes, an op inside such a block is
    not one it may recompute (:data:`autoremat.solvers.REGION_SOLVERS`), and it searches the lower
    sets of every op for what ``blocks`` plans over whole module calls. Measured (x86_64, 2 cores,
    shared; ``times="flops"`` captures of :mod:`autoremat.zoo.hf_breadth` and :mod:`autoremat.zoo.hf`):
    on the 29 such graphs of at most :data:`AUTO_LEAST_MAX_NODES` nodes its least-peak search never
    reached below the other solvers' least budget (1.17-2.92x it where it closed, 16 graphs; no
    answer on 13) and took 0.3-4.0 s of the 0.4-4.6 s ``least_budget(graph, "auto")`` took; on 12
    of them solved at their least budget, 50 % and 75 %, ``auto`` chose the same plans without it,
    each solve up to 1.1 s faster."""
    if graph.ops_blocks:
        logger.debug("milp (lattice, for auto): not asked: a module-level graph with its blocks captured op by op")
        return None
    name, limit = "AUTO_MAX_NODES", AUTO_MAX_NODES
    if least and AUTO_MAX_NODES > 0 and AUTO_LEAST_MAX_NODES > limit:
        name, limit = "AUTO_LEAST_MAX_NODES", AUTO_LEAST_MAX_NODES
    if len(graph) > limit:
        logger.debug("milp (lattice, for auto): not asked: %d nodes > %s=%d", len(graph), name, limit)
        return None
    few = graph in _lattices or all_lower_sets(GraphBits(graph), AUTO_MAX_LOWER_SETS) is not None
    lat = lattice_of(graph, tails=True) if few else None
    if lat is None or len(lat.fam) > AUTO_MAX_LOWER_SETS:
        logger.debug("milp (lattice, for auto): not asked: more than AUTO_MAX_LOWER_SETS=%d lower sets",
                     AUTO_MAX_LOWER_SETS)
        return None
    return lat


def auto_least_peak(graph: Graph) -> int | None:
    """The simulated peak of the lattice's least-peak plan (the least over its space when the
    model is exact there) when ``auto`` may ask the lattice and it closes within
    :data:`AUTO_WORK`; else ``None``. Cached per graph; the plan is kept, so
    :func:`auto_improve` finds a plan at every budget at or above it."""
    if graph in _auto_least:
        got = _auto_least[graph]
        return None if got is None else got[0]
    lat = _auto_lattice(graph, least=True)
    if lat is None:
        return None
    start = time.monotonic()
    ans = lat.least_peak(work=AUTO_WORK if len(graph) <= AUTO_MAX_NODES else AUTO_LEAST_WORK)
    if ans.seq is None:
        logger.debug("milp (lattice, for auto): least peak %s after %.1f s (%.0f work units)", ans.status,
                     time.monotonic() - start, ans.work)
        _auto_least[graph] = None
        return None
    plan = _plan(ans)
    peak = judge(graph, plan)[0]
    _auto_least[graph] = (peak, plan)
    return peak


def auto_improve(graph: Graph, budget: int, extra_s: float) -> Plan | None:
    """The lattice's optimum at ``budget`` when it closes within :data:`AUTO_WORK` and
    recomputes less than ``extra_s`` (the best other plan's extra time; ``math.inf`` where no
    other solver fits: then any plan that fits, the least-peak plan of :func:`auto_least_peak`
    when the search does not close), simulated to fit; else ``None`` (too large a graph, not
    closed in time, or nothing cheaper; the reason logged at DEBUG). Needs no ``highspy``."""
    if extra_s <= 0:
        return None
    if extra_s == math.inf and len(graph) > AUTO_MAX_NODES:  # no time search there: the least-peak plan
        return _least_plan(graph, budget)
    lat = _auto_lattice(graph)
    if lat is None:
        return None
    start = time.monotonic()
    ans = lat.least_time(budget, incumbent=extra_s * (1 - 1e-9), work=AUTO_WORK)
    if ans.seq is None:
        logger.debug("milp (lattice, for auto): %s after %.1f s (%d labels, %.0f work units); %s", ans.status,
                     time.monotonic() - start, ans.labels, ans.work, "nothing recomputes less"
                     if ans.status == "optimal" else "no plan fits" if ans.status == "infeasible"
                     else "not closed within AUTO_WORK")
        return _least_plan(graph, budget) if extra_s == math.inf and ans.status == "time_limit" else None
    plan = _plan(ans)
    peak, extra = judge(graph, plan, tails=True)
    if peak > budget or extra >= extra_s:
        logger.debug("milp (lattice, for auto): its plan simulates at %d bytes, extra %.6g s (budget %d, to beat "
                     "%.6g s); not taken", peak, extra, budget, extra_s)
        return None
    plan.options.update({"milp_status": "optimal", "optimality_gap": 0.0, "optimum_bound_s": ans.bound,
                         "milp_bound_basis": TAILS_BASIS if lat.p.tails else "exact model", "k": len(graph)})
    return plan


def _least_plan(graph: Graph, budget: int) -> Plan | None:
    """The plan of :func:`auto_least_peak` where its simulated peak fits ``budget`` (it fits; it
    is not proven the least extra time), else ``None``."""
    least = auto_least_peak(graph)
    if least is None or least > budget:
        return None
    known = _auto_least[graph]
    assert known is not None
    logger.debug("milp (lattice, for auto): the least-peak plan (%d bytes) fits %d bytes", least, budget)
    return Plan(list(known[1].segments), solver="milp")
