"""The search of ``"milp"``: the relaxation of :mod:`.formulation`, checked by the simulator.

Each round solves the program (HiGHS, within what is left of the time limit), decodes its
plan and simulates it (as :func:`autoremat.solvers.finalize_plan` will: with replay tails on fx
graphs, and also without them, the cost every solver optimises). A plan is *feasible* when
both simulated peaks fit the budget.

* Time-centric: a feasible plan becomes the incumbent (HiGHS then prunes everything not better
  than it); an infeasible one is removed by a no-good cut on its binaries, and while there is
  no incumbent the program is also solved at a budget lowered by the excess seen so far
  (only to find plans; its bound is not used). The program's bound (HiGHS's dual bound, the
  largest over the rounds) is a lower bound of the optimum because the relaxation admits every
  feasible plan and a cut removes only an infeasible one; the search stops when the program
  has no plan better than the incumbent (gap 0, proven optimal) or the time is up.
* Memory-centric: minimise the peak variable; each simulated plan adds the cut
  ``P >= peak(x*) * (1 - hamming(x, x*))`` (its true peak, exact at ``x*`` and vacuous
  elsewhere); the bound is the program's, the incumbent the least simulated peak.

Plans from other solvers (``seeds``) are incumbents when they have at most ``k`` segments.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...graph import Graph
from ...plan import Plan, Segment
from ...replay_tail import replay_tails, takes_tails
from ...cost import simulate, unoptimised_peak_bytes
from ...cost.segment_replay import TAIL_TIE
from .formulation import Formulation, constant_floor
from .highs import load_highspy, run
from .lattice import lattice_plan_nodes

__all__ = ["Outcome", "Search", "judge", "best_fit", "path_plan", "PROGRESS_EVERY_S"]

logger = logging.getLogger("autoremat.solvers.milp")

PROGRESS_EVERY_S = 5.0
"""A search running longer logs incumbent, bound and gap this often (INFO on ``autoremat.solvers.milp``)."""


@dataclass
class Outcome:
    """What a search proved: ``cost`` of ``plan`` (seconds of extra time without replay tails, or
    bytes of step peak) and a proven lower ``bound`` of the optimum over plans of at most ``k``
    segments; ``status`` is ``"optimal"``, ``"time_limit"`` or ``"infeasible"``."""

    plan: Plan | None
    cost: float | None
    bound: float
    status: str
    rounds: int = 0
    cuts: int = 0
    seconds: float = 0.0
    k: int = 0
    history: list[tuple[float, float | None, float]] = field(default_factory=list)
    basis: str = "program"
    """What the bound is proven over: ``"program"`` (the simulator's relaxation, :mod:`.formulation`),
    ``"separators"`` (the simulator's levels where every plan meets, :mod:`.cut_bound`) or ``"exact model"``
    (the lattice search over :mod:`autoremat.cost.segment_replay`, :mod:`.exact`)."""

    def raise_bound(self, bound: float, basis: str, rel: float = 0.0) -> None:
        """Keep ``bound`` (proven over ``basis``) where it is the larger; ``"optimal"`` once the bound
        meets the cost (within ``rel`` of it)."""
        if bound > self.bound:
            self.bound, self.basis = bound, basis
        if self.cost is not None and self.bound >= self.cost * (1 - rel):
            self.status = "optimal"

    @property
    def gap(self) -> float | None:
        """``(cost - bound) / cost`` (0 when both are 0; ``None`` without a plan)."""
        if self.cost is None:
            return None
        if self.cost <= 0 or self.bound >= self.cost:
            return 0.0
        return max(0.0, (self.cost - max(self.bound, 0.0)) / self.cost)


def path_plan(seq: list[int], flags: list[bool]) -> Plan:
    """The bare ``milp`` plan of a lower-set path ``seq`` (bitsets) with a recompute flag per segment."""
    return Plan([Segment(tuple(nodes), f) for nodes, f in zip(lattice_plan_nodes(seq), flags)], solver="milp")


def judge(graph: Graph, plan: Plan, tails: bool = False) -> tuple[int, float]:
    """``(peak, extra time)``: the larger of the simulated peaks with and without the replay tails
    :func:`~autoremat.solvers.finalize_plan` adds (fx graphs), and the extra time without them
    (``tails``: with them, as the plan runs, plus :data:`~autoremat.cost.segment_replay.TAIL_TIE` of
    the time without them: the time of a search whose model prices them, :attr:`GraphBits.tails
    <autoremat.cost.bitsets.GraphBits.tails>`)."""
    bare = Plan(list(plan.segments), solver=plan.solver)
    sim = simulate(graph, bare, check=False, record=False)
    peak, extra = sim.peak_bytes, sim.extra_time_s
    ran = extra
    bare.replay_tails = replay_tails(graph, bare)
    if bare.replay_tails:
        tailed = simulate(graph, bare, check=False, record=False)
        peak, ran = max(peak, tailed.peak_bytes), tailed.extra_time_s
    return peak, (ran + TAIL_TIE * extra if tails and takes_tails(graph) else extra)


def best_fit(graph: Graph, plans: Iterable[Plan], budget: int, *, tails: bool = False,
             k: int | None = None) -> tuple[Plan | None, float]:
    """``(plan, extra time)`` of the plan of ``plans`` (of at most ``k`` segments) that :func:`judge`
    puts within ``budget`` with the least extra time (``tails``: as it runs), as a bare ``milp`` plan;
    ``(None, inf)`` where none fits."""
    best, cost = None, math.inf
    for plan in plans:
        if k is not None and len(plan.segments) > k:
            continue
        peak, extra = judge(graph, plan, tails=tails)
        if peak <= budget and extra < cost:
            best, cost = Plan(list(plan.segments), solver="milp"), extra
    return best, cost


@contextmanager
def _reporting(out: Outcome, start: float, what: str, unit: str) -> Iterator[None]:
    """While one HiGHS run is in progress, log the search's incumbent, bound and gap every
    :data:`PROGRESS_EVERY_S` seconds (the bound is the one proven before this run)."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(max(0.01, PROGRESS_EVERY_S)):
            logger.info("milp%s: round %d running, %.1f s: incumbent %s, bound %.6g %s, gap %s, %d cuts", what,
                        out.rounds + 1, time.monotonic() - start,
                        "none" if out.cost is None else f"{out.cost:.6g} {unit}", max(out.bound, 0.0), unit,
                        "-" if out.gap is None else f"{out.gap:.2%}", out.cuts)

    thread = threading.Thread(target=report, daemon=True, name="autoremat-milp-progress")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class Search:
    """One program (graph, ``k``, objective) in HiGHS, reused across budgets."""

    def __init__(self, graph: Graph, k: int, objective: str, threads: int | None = None) -> None:
        self.highspy = load_highspy()
        self.graph = graph
        self.k = k
        self.objective = objective
        self.reference = max(1, unoptimised_peak_bytes(graph))
        self.floor = constant_floor(graph)
        self.f = Formulation(graph, k, objective).build(self.reference)
        self.h = self.f.b.build(self.highspy, threads)
        if objective == "memory":
            assert self.f.peak_var is not None
            self.h.changeColBounds(self.f.peak_var, self.floor * self.f.mem_scale, float("inf"))
        self.cuts = 0
        self.excluded: set[tuple[int, ...]] = set()

    # -------------------------------------------------------------- cuts
    def _key(self, vals: dict[int, float]) -> tuple[int, ...]:
        return tuple(int(vals[c] > 0.5) for c in self.f.binaries())

    def _nogood(self, vals: dict[int, float], peak_scaled: float | None = None) -> None:
        """Exclude ``vals`` (time) or bound ``P`` at it (memory)."""
        key = self._key(vals)
        if key in self.excluded:
            return
        self.excluded.add(key)
        cols = self.f.binaries()
        ones = [c for c, on in zip(cols, key) if on]
        coef = {c: (-1.0 if on else 1.0) for c, on in zip(cols, key)}
        if peak_scaled is None:  # sum over ones of (1 - b) + sum over zeros of b >= 1
            self.f.b.row(coef, 1.0 - len(ones), float("inf"))
        else:  # P + S * (sum zeros b - sum ones b) >= S - S * |ones|
            row = {c: peak_scaled * a for c, a in coef.items()}
            row[self.f.peak_var] = 1.0  # type: ignore[index]
            self.f.b.row(row, peak_scaled - peak_scaled * len(ones), float("inf"))
        self.cuts += 1

    def _values(self, values: Iterable[float]) -> dict[int, float]:
        vals = list(values)
        return {c: vals[c] for c in self.f.binaries()}

    # -------------------------------------------------------------- time-centric
    def minimise_time(self, budget: int, time_limit_s: float, seeds: Iterable[Plan] = ()) -> Outcome:
        start = time.monotonic()
        out = Outcome(None, None, -math.inf, "time_limit", k=self.k)
        if self.floor > budget:
            out.status, out.bound = "infeasible", math.inf
            return out
        for plan in seeds:
            self._offer(out, plan, budget)
        ts = self.f.time_scale
        lowered = 0
        last_log = start
        while True:
            left = time_limit_s - (time.monotonic() - start)
            if left <= 0:
                break
            self.f.set_budget(self.h, budget)
            cutoff = None if out.cost is None else out.cost * ts * (1 - 1e-6) - 1e-9
            out.cuts = self.cuts
            with _reporting(out, start, "", "s"):
                res = run(self.h, self.highspy, left, cutoff)
            out.rounds += 1
            if res.status == "infeasible":
                out.bound = math.inf if out.cost is None else max(out.bound, out.cost)
                out.status = "infeasible" if out.cost is None else "optimal"
                break
            out.bound = max(out.bound, res.bound / ts)
            if res.values is None:
                break
            vals = self._values(res.values)
            peak = self._offer(out, self.f.decode(res.values), budget, vals)
            if peak <= budget and res.status == "optimal":
                out.bound = max(out.bound, out.cost or 0.0)
                out.status = "optimal"
                break
            if peak > budget and out.cost is None:  # look for any plan at a lowered budget
                lowered += peak - budget
                left = time_limit_s - (time.monotonic() - start)
                if left > 0 and budget - lowered >= self.floor:
                    self.f.set_budget(self.h, budget - lowered)
                    alt = run(self.h, self.highspy, left / 2)
                    if alt.values is not None:
                        self._offer(out, self.f.decode(alt.values), budget, self._values(alt.values))
            if time.monotonic() - last_log >= PROGRESS_EVERY_S:
                last_log = time.monotonic()
                logger.info("milp: round %d, %.1f s: incumbent %s, bound %.6g s, gap %s, %d cuts", out.rounds,
                            last_log - start, "none" if out.cost is None else f"{out.cost:.6g} s", out.bound,
                            "-" if out.gap is None else f"{out.gap:.2%}", self.cuts)
        out.bound = max(out.bound, 0.0)  # extra time is never negative (HiGHS may stop before any bound)
        if out.cost is not None and out.bound >= out.cost * (1 - 1e-6):
            out.status = "optimal"
        out.seconds = time.monotonic() - start
        out.cuts = self.cuts
        return out

    def _offer(self, out: Outcome, plan: Plan, budget: int, vals: dict[int, float] | None = None) -> int:
        """Simulate ``plan``; keep it when it fits and beats the incumbent, cut it when it does
        not fit. Returns its peak (plans outside the program's space count as not offered)."""
        if vals is None:
            enc = self.f.encode(plan)
            if enc is None:
                return budget + 1
            vals = enc
        peak, extra = judge(self.graph, plan)
        if peak > budget:
            self._nogood(vals)
        elif out.cost is None or extra < out.cost:
            plan.solver = "milp"
            out.plan, out.cost = plan, extra
        return peak

    # -------------------------------------------------------------- memory-centric
    def minimise_peak(self, time_limit_s: float, seeds: Iterable[Plan] = ()) -> Outcome:
        start = time.monotonic()
        out = Outcome(None, None, float(self.floor), "time_limit", k=self.k)
        ms = self.f.mem_scale
        for plan in seeds:
            enc = self.f.encode(plan)
            if enc is not None:
                self._peak_offer(out, plan, enc)
        last_log = start
        while out.cost is None or out.bound < out.cost:
            left = time_limit_s - (time.monotonic() - start)
            if left <= 0:
                break
            cutoff = None if out.cost is None else (out.cost - 0.5) * ms
            out.cuts = self.cuts
            with _reporting(out, start, " (least budget)", "bytes"):
                res = run(self.h, self.highspy, left, cutoff)
            out.rounds += 1
            if res.status == "infeasible":
                out.bound = max(out.bound, out.cost if out.cost is not None else math.inf)
                break
            if math.isfinite(res.bound):  # HiGHS stopped by the time limit may report no bound
                out.bound = max(out.bound, math.ceil(res.bound / ms - 1e-6))
            if res.values is None:
                break
            self._peak_offer(out, self.f.decode(res.values), self._values(res.values))
            if time.monotonic() - last_log >= PROGRESS_EVERY_S:
                last_log = time.monotonic()
                logger.info("milp (least budget): round %d, %.1f s: incumbent %s bytes, bound %d bytes, gap %s",
                            out.rounds, last_log - start, out.cost, out.bound,
                            "-" if out.gap is None else f"{out.gap:.2%}")
        out.status = "optimal" if out.cost is not None and out.bound >= out.cost else out.status
        if out.cost is None and out.bound == math.inf:
            out.status = "infeasible"
        out.seconds = time.monotonic() - start
        out.cuts = self.cuts
        return out

    def _peak_offer(self, out: Outcome, plan: Plan, vals: dict[int, float]) -> None:
        peak, _ = judge(self.graph, plan)
        self._nogood(vals, peak * self.f.mem_scale)
        if out.cost is None or peak < out.cost:
            plan.solver = "milp"
            out.plan, out.cost = plan, float(peak)
