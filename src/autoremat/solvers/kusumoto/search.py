"""One Kusumoto search per graph and options: the DP plus the simulator checks around it.

:class:`Search` builds the family (all lower sets for ``dp-exact``, the pruned family for
``dp-approx``, or the fallback), the DP of its memory model (:class:`~.exact.ExactDP` or
:class:`~.closed.ClosedDP`), finds the least budget (:meth:`Search.minimum`) and solves a budget
(:meth:`Search.solve`), simulating every plan it returns. :func:`search_for` caches searches per
graph object (see the package docstring, "Least budget" and "Speed").
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...cost import no_recompute_plan, simulate
from ...cost.bitsets import GraphBits, bits
from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, segments_from_lower_sets
from ..chen import chen_plans
from ..content_keys import memory_signature, signature
from .closed import ClosedDP
from .config import DPApproxConfig, DPConfig, DPExactConfig
from .dp import LowerSetDP, time_quantum
from .exact import ExactDP
from .families import all_lower_sets, pruned_lower_sets

__all__ = ["Search", "Minimum", "search_for", "parse_config", "LEAST_KEPT_LABELS", "EXACT_ALWAYS_NODES"]

logger = logging.getLogger("autoremat.solvers.kusumoto")


@dataclass(frozen=True)
class Minimum:
    """What :meth:`Search.minimum` finds."""

    budget_bytes: int
    """The solver's least budget: the smaller of the unoptimised peak and the simulated peak of
    the sequence the DP finds at the least budget its model accepts."""
    dp_budget_bytes: int
    """The least budget at which the DP's model admits a sequence."""
    plan: Plan | None
    """The plan there (``None`` when no recomputation is the least)."""
    source: str = "DP"
    """Where that plan comes from: ``"DP"`` (the sequence the DP finds at its least budget),
    ``"exact model"`` (dp-approx's second opinion) or ``"Chen"`` (Chen's least plan)."""


LEAST_KEPT_LABELS = 20_000  # dp-exact's minimum also tries the least-kept sequence up to this many labels
EXACT_PROBE_REPLAYS = 5_000
"""dp-approx's probe of its exact model below the least known peak stops after this many new exact
replays without an answer (:meth:`Search._exact_least`)."""
EXACT_ALWAYS_NODES = 40
LEAST_SEQUENCE = "the sequence found at the least DP budget"
"""dp-approx asks its exact model at every budget on graphs of at most this many nodes (where it
costs little), and elsewhere only where the closed form's plan fails (see the package docstring)."""


class Search:
    """One graph, one family, one model: the DP plus the simulator checks around it."""

    def __init__(self, graph: Graph, solver: str, cfg: dict[str, Any]) -> None:
        self._graph = weakref.ref(graph)  # the cache must not keep the graph alive
        self.solver = solver
        self.cfg = cfg
        p = self.p = GraphBits(graph)
        self.quantum = time_quantum(p, cfg["time_slots"])
        self.fallback_reason = self.fallback_message = ""
        self.lock = threading.RLock()  # one search at a time (its tables are shared across calls)
        self.broken = False  # set when a call was interrupted: never reused
        family: list[int] | None = None
        exact = solver == "dp-exact"
        if exact:
            limit = cfg["max_lower_sets"]
            family = all_lower_sets(p, limit)
            if family is None:
                msg = (f"dp-exact: the graph has more than max_lower_sets={limit} lower sets "
                       "(the exact DP is quadratic in their number)")
                if not cfg["fallback"]:
                    raise ValueError(msg + "; raise max_lower_sets, or pass fallback=True to use dp-approx")
                self.fallback_message = f"{msg}; falling back to dp-approx (pruned family, closed-form model)"
                self.fallback_reason = f"more than {limit} lower sets"
                exact = False
        if exact:
            assert family is not None, "please report"
            self.family_name = "all lower sets"
            self.model_name = "segment replay"
        else:
            family = pruned_lower_sets(p)
            self.family_name = "pruned: {L^v} + {∅, V}"
            self.model_name = "closed form"
        self.dp: LowerSetDP = ExactDP(p, family, self.quantum) if exact else ClosedDP(p, family, self.quantum)
        self._vanilla: tuple[Plan, int] | None = None
        self._min: Minimum | None = None
        self._chen: list[tuple[int, float, Plan]] | None = None
        self._second: ExactDP | None = None

    @property
    def small(self) -> bool:
        """Whether dp-approx asks its exact model at every budget (:data:`EXACT_ALWAYS_NODES`)."""
        return len(self.p.time) <= EXACT_ALWAYS_NODES

    @property
    def graph(self) -> Graph:
        graph = self._graph()
        assert graph is not None, "the graph of a search was collected during a call; please report"
        return graph

    # -------------------------------------------------------------- plans and the simulator
    def plan_of(self, seq: Sequence[int]) -> Plan:
        lists = [list(bits(m)) for m in seq]
        return Plan(segments_from_lower_sets(self.graph, lists), solver=self.solver)

    def peak(self, plan: Plan) -> int:
        return simulate(self.graph, plan, check=False, record=False).peak_bytes

    def judge(self, plan: Plan) -> tuple[int, float]:
        """The simulated ``(peak, extra time)`` of ``plan``."""
        sim = simulate(self.graph, plan, check=False, record=False)
        return sim.peak_bytes, sim.extra_time_s

    # -------------------------------------------------------------- Chen's plans and the second opinion
    def chen(self) -> list[tuple[int, float, Plan]]:
        """``(peak, extra time, plan)`` of every plan Chen's method tries (cached): the DP's plans
        are checked against the cheapest of them that fits (see the package docstring, "Checks")."""
        if self._chen is None:
            self._chen = chen_plans(self.graph)
        return self._chen

    def chen_best(self, budget: int) -> tuple[int, float, Plan] | None:
        """Chen's cheapest plan within ``budget`` (least extra time, then least peak), or ``None``."""
        fits = [t for t in self.chen() if t[0] <= budget]
        return min(fits, key=lambda t: (t[1], t[0])) if fits else None

    def second_opinion(self) -> ExactDP:
        """dp-approx's exact model: :class:`~.exact.ExactDP` (the simulator's rules replayed per
        segment) over the pruned family and the lower sets of Chen's plans (built once)."""
        if self._second is None:
            assert not self.dp.exact, "please report"
            sets = set(self.dp.fam)
            for _, _, plan in self.chen():
                lower = 0
                for seg in plan.segments:
                    for v in seg.nodes:
                        lower |= 1 << v
                    sets.add(lower)
            family = sorted(sets, key=lambda m: (m.bit_count(), m))
            self._second = ExactDP(self.p, family, self.quantum)
        return self._second

    def vanilla(self) -> tuple[Plan, int]:
        if self._vanilla is None:
            plan = no_recompute_plan(self.graph)
            plan.solver = self.solver
            self._vanilla = (plan, self.peak(plan))
        return self._vanilla

    # -------------------------------------------------------------- the least budget
    def least_dp_budget(self, dp: LowerSetDP | None = None) -> tuple[int, list[int]]:
        """The least budget at which the DP's model admits a sequence, and that sequence.

        Binary search over bytes (Kusumoto §5.1) on the DP's feasibility. It gallops up from
        1/64 of the unoptimised need so that probes stay near the answer, where the DP is
        cheap; a probe that succeeds lowers the upper end to its sequence's model peak, and
        halving probes alternate with probes one byte below the upper end (the answer is the
        peak of some sequence, so such a probe often closes the search at once).
        """
        dp = dp or self.dp
        seq = [self.p.full]
        hi = dp.model_peak(seq)[0]  # the one-segment sequence always fits its own need
        lo = -1
        probe = hi >> 6
        # a probe above the answer prices every transition its budget admits (replays for the
        # exact DP), so both climb in small steps (see the module docstring)
        growth = 1.1 if dp.exact else 1.25
        while lo + 1 < probe < hi:
            found = dp.run(probe, "feasible")
            if found is not None:
                seq = found[0]
                hi = dp.model_peak(seq)[0]
                break
            lo = probe
            probe = max(probe + 1, int(probe * growth))
        below = True  # alternate "just below hi" (proves hi least when it fails) and halving probes
        while hi - lo > 1:
            mid = hi - 1 if below else (lo + hi) // 2
            below = not below
            found = dp.run(mid, "feasible")
            if found is not None:
                seq = found[0]
                hi = dp.model_peak(seq)[0]
            else:
                lo = mid
        return hi, seq

    def _exact_least(self, best: int) -> tuple[int, list[int]] | None:
        """:meth:`least_dp_budget` of the exact model (:meth:`second_opinion`), or ``None`` where no
        sequence fits ``best`` (the least simulated peak known) in it. A probe one byte below ``best``
        comes first: where nothing fits there, ``best`` is the model's least if anything fits it (a second
        probe), and the search, which proves every smaller budget infeasible from 1/64 up, is not paid
        (measured: the first ``solve`` of a 374-node Qwen3-MoE capture under bf16 probed 47 budgets in
        7 s to find the least it already knew). Kept by the graph's bytes and structure
        (:func:`memory_signature`): the exact model's feasibility reads no times, so the reference graph
        of a stable plan (:mod:`autoremat.solvers.stable`: the same bytes, other times) meets the
        measured graph's answer instead of searching again.

        Decision: each probe stops after :data:`EXACT_PROBE_REPLAYS` new exact replays without an
        answer and counts as "nothing fits" (logged): dp-approx is the approximate solver, and that
        proof is what its first ``solve`` pays most for. Measured (x86_64, first probe of
        each graph): the 24 Hugging Face breadth models that probe and the CPU-size zoo paid 38-2,397
        replays (0.04-0.77 s), and only the zoo's GPT found a lower least budget there (1,859 replays,
        4,918,984 -> 4,867,784 B); LeViT paid 30,472 replays, 9.2 s of its 9.5 s first solve, to find
        nothing below. A count, not a clock, so the answer does not depend on the machine's load."""
        key = (memory_signature(self.graph), self.solver, self.cfg.get("max_lower_sets"), self.cfg.get("fallback"),
               best, EXACT_PROBE_REPLAYS)
        with _cache_lock:
            got = _EXACT_LEAST.get(key, False)
        if got is False:
            second = self.second_opinion()
            if second.dive.run(best - 1, EXACT_PROBE_REPLAYS) is not None:  # it may beat what is known: search
                got = self.least_dp_budget(second)
            else:  # it cannot (or the probe stopped): ``best`` is its least where anything fits it
                stopped = second.dive.stopped
                at = second.dive.run(best, EXACT_PROBE_REPLAYS)
                got = None if at is None else (best, at[0])
                if stopped or second.dive.stopped:
                    logger.info("%s: the exact model's probes at %d bytes stopped after %d replays without an "
                                "answer (EXACT_PROBE_REPLAYS); its least budget stays the closed form's or Chen's",
                                self.solver, best, EXACT_PROBE_REPLAYS)
            with _cache_lock:
                _EXACT_LEAST[key] = got
                while len(_EXACT_LEAST) > _EXACT_LEAST_KEPT:
                    _EXACT_LEAST.popitem(last=False)
        return None if got is None else (got[0], list(got[1]))

    def model_peak(self, seq: Sequence[int]) -> int:
        """The DP model's peak of a sequence (the least budget at which the DP accepts it)."""
        return self.dp.model_peak(seq)[0]

    def minimum(self) -> Minimum:
        """The least budget, the least DP budget and the DP's plan there (cached).

        The solver's minimum is the smaller of the unoptimised peak and the simulated peak of
        the sequence the DP finds at the least budget its model accepts.
        """
        with self.lock, self._guard():
            return self._minimum()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Marks the search broken when a call is interrupted (KeyboardInterrupt, a timeout
        signal…) mid-way: its tables may then be half-updated, so the cache drops it. An
        infeasible budget is an answer, not an interruption: the search stays usable."""
        try:
            yield
        except InfeasibleBudgetError:
            raise
        except BaseException:
            self.broken = True
            raise

    def _minimum(self) -> Minimum:
        if self._min is not None:
            return self._min
        _, van_peak = self.vanilla()
        dp_min, seq = self.least_dp_budget()
        candidates = [seq]
        if self.dp.exact:  # the least-kept sequence too, first (kept on ties), when it is cheap
            assert isinstance(self.dp, ExactDP), "please report"
            alt = self.dp.least_kept(dp_min, LEAST_KEPT_LABELS)
            if alt is not None and alt != seq:
                candidates.insert(0, alt)
        plans = [self.plan_of(c) for c in candidates]
        peaks = [self.peak(p) for p in plans]
        at = peaks.index(min(peaks))
        plan, peak, source = plans[at], peaks[at], "DP"
        chen_peak, _, chen_plan = min(self.chen(), key=lambda t: (t[0], t[1]))
        if not self.dp.exact and (chen_peak < peak or self.small):  # ask the exact model
            logger.info("%s: Chen's least plan simulates to %d bytes, the closed form's least to %d; finding the "
                        "least budget of the exact model", self.solver, chen_peak, peak)
            found = self._exact_least(min(peak, chen_peak))
            alt_plan = None if found is None else self.plan_of(found[1])
            alt_peak = None if alt_plan is None else self.peak(alt_plan)
            if alt_peak is not None and alt_peak < peak:
                plan, peak, source = alt_plan, alt_peak, "exact model"
        if chen_peak < peak:
            logger.info("%s: Chen's least plan (%d bytes) is below the DP's (%d bytes); it is the least-budget "
                        "plan", self.solver, chen_peak, peak)
            plan, peak, source = chen_plan, chen_peak, "Chen"
        self._min = Minimum(peak, dp_min, plan, source) if peak < van_peak else Minimum(van_peak, dp_min, None)
        return self._min

    # -------------------------------------------------------------- solve
    def solve(self, budget: int, cfg: dict[str, Any]) -> Plan:
        """The plan for ``budget`` under ``cfg``'s objective and tightenings (the search's own
        options, family and time grid, are fixed at construction)."""
        with self.lock, self._guard():
            if self.fallback_reason:
                logger.warning("%s", self.fallback_message)
            return self._solve(budget, cfg)

    def _solve(self, budget: int, cfg: dict[str, Any]) -> Plan:
        van_plan, van_peak = self.vanilla()
        if len(self.graph) == 0:
            return self._stamp(cfg, van_plan, "no nodes")
        objective = cfg["objective"]
        if objective == "time" and van_peak <= budget:
            return self._stamp(cfg, van_plan, "no recomputation: the budget does not bind")
        least = self._minimum()
        need, dp_min, min_plan = least.budget_bytes, least.dp_budget_bytes, least.plan
        if budget < need:
            raise InfeasibleBudgetError(budget, need, solver=self.solver)
        fallback = min_plan or van_plan
        if objective == "memory":
            found = self.dp.run(dp_min, "memory")
            if found is not None:
                plan = self.plan_of(found[0])
                if self.peak(plan) <= budget:
                    return self._stamp(cfg, plan, "memory-centric: most recomputation at the least DP budget",
                                       dp_budget=dp_min)
            why = LEAST_SEQUENCE if least.source == "DP" else (
                f"the least-budget plan ({least.source})")
            logger.warning("%s: the memory-centric plan does not fit %d bytes in simulation; using %s (%d bytes)",
                           self.solver, budget, why, need)
            return self._stamp(cfg, fallback, why, dp_budget=dp_min)
        return self._time_centric(budget, cfg, least)

    def _tighten(self, dp: LowerSetDP, budget: int, cfg: dict[str, Any],
                 dp_min: int | None) -> tuple[Plan, int, int] | None:
        """The first plan of ``dp``'s time-centric search that fits ``budget`` in simulation, with
        its DP budget and the number of tightenings: a plan over the budget lowers the DP budget
        by its excess (``max_tightenings`` times at most, never below ``dp_min``)."""
        dp_budget = budget
        for attempt in range(cfg["max_tightenings"] + 1):
            if dp_min is not None and dp_budget < dp_min:
                break
            found = dp.run(dp_budget, "time")
            if found is None:
                break
            plan = self.plan_of(found[0])
            peak = self.peak(plan)
            if peak <= budget:
                return plan, dp_budget, attempt
            logger.info("%s: the DP's plan for %d bytes simulates to %d bytes; tightening the DP budget",
                        self.solver, dp_budget, peak)
            dp_budget -= max(peak - budget, 1)
        return None

    def _time_centric(self, budget: int, cfg: dict[str, Any], least: Minimum) -> Plan:
        """The time-centric plan, checked (see the package docstring, "Checks"): the DP's plan
        that fits in simulation; for dp-approx, the exact model's when the closed form's does not
        fit or recomputes more than Chen's plan at this budget; the cheapest of those, Chen's
        plan and the least-budget plan."""
        # (extra time, peak, rank, plan, why, DP budget, tightenings): the least extra time wins, then rank
        options: list[tuple[float, int, int, Plan, str, int | None, int]] = []
        found = self._tighten(self.dp, budget, cfg, least.dp_budget_bytes)
        if found is not None:
            peak, extra = self.judge(found[0])
            options.append((extra, peak, 0, found[0], "time-centric", found[1], found[2]))
        chen = self.chen_best(budget)
        if not self.dp.exact and (found is None or self.small or (chen is not None and options[0][0] > chen[1])):
            why = ("no plan of the closed form fits in simulation" if found is None else
                   "the closed form's plan recomputes more than Chen's" if chen is not None and options[0][0] > chen[1]
                   else f"the graph is small ({len(self.p.time)} nodes)")
            logger.info("%s: %s at %d bytes; asking the exact model", self.solver, why, budget)
            second = self._tighten(self.second_opinion(), budget, cfg, None)
            if second is not None:
                peak, extra = self.judge(second[0])
                options.append((extra, peak, 1, second[0], "time-centric, exact model", second[1], second[2]))
        if chen is not None:
            options.append((chen[1], chen[0], 2, chen[2], "Chen's plan", None, 0))
        if least.plan is not None:
            peak, extra = self.judge(least.plan)
            if peak <= budget:
                if least.source == "DP":
                    options.append((extra, peak, 3, least.plan, LEAST_SEQUENCE, least.dp_budget_bytes, 0))
                else:
                    options.append((extra, peak, 3, least.plan, f"the least-budget plan ({least.source})", None, 0))
        assert options, f"{self.solver}: no plan within {budget} bytes above the least budget; please report"
        extra, peak, rank, plan, why, dp_budget, tightenings = min(options, key=lambda o: (o[0], o[2]))
        if rank > 1 and not (rank == 3 and least.source == "DP" and budget == least.budget_bytes):
            logger.info("%s: %s (%d bytes, extra time %.6g s) beats the DP's plans at %d bytes", self.solver, why,
                        peak, extra, budget)
        return self._stamp(cfg, plan, why, dp_budget=dp_budget, tightenings=tightenings)

    def _stamp(self, cfg: dict[str, Any], plan: Plan, why: str, *, dp_budget: int | None = None, tightenings: int = 0) -> Plan:
        """A copy of ``plan`` with the solver's options recorded."""
        plan = Plan(list(plan.segments), solver=self.solver, options=dict(plan.options))
        plan.options.update({
            "objective": cfg["objective"],
            "family": self.family_name,
            "family_size": len(self.dp.fam),
            "memory_model": self.model_name,
            "time_slots": self.cfg["time_slots"],
            "time_quantum_s": self.quantum,
            "dp_budget_bytes": dp_budget,
            "tightenings": tightenings,
            "chosen": why,
        })
        if self.fallback_reason:
            plan.options["fallback"] = f"dp-approx ({self.fallback_reason})"
        return plan


# Each live graph keeps the searches of its last few option sets, so that the usual sequence
# "min_budget(g) (or a solve that raises InfeasibleBudgetError) then solve(g, b)" finds the least
# budget once: a search holds its DP tables (priced transitions, replays) and its minimum. The
# cache holds graphs weakly and a search holds its graph weakly, so a search (dp-exact's tables
# reach a gigabyte on PSPNet) goes when its graph does. A graph edited in place is recognised by
# a signature of its content and gets a new search.
_CACHE_SIZE = 3  # option sets kept per graph
_cache: weakref.WeakKeyDictionary[Graph, OrderedDict[tuple[str, int, int, bool], tuple[int, Search]]] = (
    weakref.WeakKeyDictionary())
_cache_lock = threading.Lock()


_EXACT_LEAST_KEPT = 8
_EXACT_LEAST: OrderedDict[tuple, tuple[int, list[int]] | None] = OrderedDict()  # Search._exact_least's answers


def search_for(graph: Graph, solver: str, cfg: dict[str, Any]) -> Search:
    """The (cached) search for ``graph`` under the options that shape it."""
    key = (solver, cfg["time_slots"], cfg["max_lower_sets"], cfg["fallback"])
    sig = signature(graph)
    with _cache_lock:
        mine = _cache.get(graph)
        got = None if mine is None else mine.get(key)
        if got is not None and got[0] == sig and not got[1].broken:
            mine.move_to_end(key)  # type: ignore[union-attr]
            return got[1]
    search = Search(graph, solver, cfg)
    with _cache_lock:
        mine = _cache.setdefault(graph, OrderedDict())
        mine[key] = (sig, search)
        mine.move_to_end(key)
        while len(mine) > _CACHE_SIZE:
            mine.popitem(last=False)
    return search


def parse_config(config: Mapping[str, Any] | DPConfig | None, solver: str) -> dict[str, Any]:
    """``config`` (a mapping, a :class:`~.config.DPConfig` or ``None``) checked, as a dict of every
    option of ``solver``'s config class."""
    cls = DPExactConfig if solver == "dp-exact" else DPApproxConfig
    if isinstance(config, DPConfig) and not isinstance(config, cls):
        config = config.as_dict()  # the shared options suit either DP
    cfg = cls.parse(config).as_dict()
    cfg["fallback"] = bool(cfg["fallback"])
    return cfg
