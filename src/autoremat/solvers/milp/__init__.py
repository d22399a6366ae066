"""``"milp"``: an exact mixed-integer program over canonical strategies, with proven gaps.

Problem: the general recomputation problem of Kusumoto et al. [1]_ (§3) in the plan space the
runtime executes: an increasing sequence of at most ``k`` lower sets, each segment
``Vi = Li \\ L(i-1)`` run plainly or recomputed (a free choice per segment, a superset of the
plans :func:`~autoremat.plan.segments_from_lower_sets` builds, which recompute every saving
segment but the last). Time-centric: the least extra time whose simulated step peak fits the
budget; memory-centric (:func:`min_budget_milp`): the least simulated step peak.

.. [1] M. Kusumoto, T. Inoue, G. Watanabe, T. Akiba, M. Koyama, "A Graph Theoretic Framework
   of Recomputation Algorithms for Memory-Efficient Backpropagation", NeurIPS 2019.

What is modelled and what is checked after (see :mod:`.formulation` and :mod:`.search`):

* the extra time is exact: the program's objective at a plan equals
  :func:`~autoremat.cost.simulate`'s extra time of that plan *without* replay tails (the
  cost every solver optimises; :func:`~autoremat.solvers.finalize_plan` then shortens the
  replays of fx plans, and the plan's ``predicted_extra_time_s`` is the simulator's, tails in);
* the step peak is not linear in full (gradient buffers shared through pass-through ops, the
  replay's own order, transients): the program holds a *relaxation*, a lower bound of the
  simulated peak at a few of its peak checks for every plan, so every plan that fits in
  simulation is feasible in the program. Every plan the program returns is simulated; one over
  the budget is cut off (a no-good cut) and the program solved again. The plan returned is
  always one the simulator put within the budget (with and without replay tails), and the
  program's dual bound is a proven lower bound of the optimum, so ``optimality_gap`` is proven.

Three bounds. With ``k`` not given, on graphs of at most :data:`.exact.MAX_LOWER_SETS` lower
sets, an exact label-setting search over every lower set (:mod:`.lattice`, :mod:`.exact`; no limit
on the number of segments) runs first and usually closes: its plan is simulated and its optimum is
proven *in the exact model* of :mod:`autoremat.cost.segment_replay` (which equals the simulator on
seeded random DAGs; ``milp_bound_basis="exact model"``). Where it does not close, or its plan fails
the simulator, within :data:`CUT_SHARE` of ``time_limit_s`` a program over the moments every plan
shares, the backward of each *separator* (a node every other node is an ancestor or a descendant
of; :mod:`.cut_bound`): which storages a plan can hold there and which it must make again, a lower
bound of the extra time of every canonical strategy (any number of segments), and a proof of
infeasibility where a separator's level cannot fit (Inception-v3 at CPU size, 50 %: the parameter
gradients alone at its first node's backward; the memory-centric search's bound is at least that
level, :func:`.cut_bound.separator_floor`). Then the program below in the time left
(``milp_bound_basis="program"``). The largest bound is reported (``"separators"`` when it is the
second's).

The answer is exact (gap 0, ``milp_status="optimal"``) when the loop closes within
``time_limit_s``; else the best plan found and its proven gap (``milp_status="time_limit"``).
Plans of other solvers (Chen, dp-approx, dp-exact where the graph has at most its
``max_lower_sets`` lower sets, xla-greedy, reforward, and the plan :func:`min_budget_milp`
found) seed the incumbent when they have at most ``k`` segments (their run time is not counted
in ``time_limit_s``).

Decisions: ``k`` defaults to 12, or to the most segments of a seed plan when that is more
(so every seed lies in the program's space and the answer is never worse than the other
solvers'), capped at the node count: the program grows as ``n * k``; the bound holds for plans
of at most ``k`` segments. An explicit ``k`` leaves out the seeds with more segments. Offload is not chosen (``milp`` plans never offload). A budget the relaxation proves
infeasible raises :class:`~autoremat.errors.InfeasibleBudgetError` with the least budget the
memory-centric search found in the time left (or the relaxation's bound when it found none);
a time limit reached with no plan at all is a ``RuntimeError`` that says so (the budget is not
proven infeasible then).

Options (``config``): ``k`` (int >= 1, or None: see above), ``time_limit_s`` (float > 0, default 60),
``objective`` (``"time"`` | ``"memory"``), ``threads`` (int, HiGHS threads; default HiGHS's),
``seeds`` (bool, default True: try the other recomputation solvers for a first incumbent), ``tails``
(bool, default False: see below); other keys are
ignored with a warning (``solve(solver="auto")`` passes one set to all solvers). Progress
(incumbent, bound, gap) is logged at INFO on ``autoremat.solvers.milp`` every
:data:`.search.PROGRESS_EVERY_S` seconds of a long search. Needs ``highspy`` (``pip install
"autoremat[milp]"``).

Priced as plans run (``tails=True``; issue 28: ``auto`` chooses its plans by that price, so a gap
over whole replays compared it in terms it does not optimise): a recomputed segment's extra time is
its replay up to its tail (:func:`~autoremat.replay_tail.replay_tails`, fx graphs; elsewhere the two
prices agree and ``tails`` changes nothing), plus :data:`~autoremat.cost.segment_replay.TAIL_TIE`
(1e-6) of its whole replay, the tie-break ``auto``'s searches use (:func:`.search.judge`): so the
extra time stamped is within 1e-6 of the simulator's as-run time. The lattice searches the tails
model (``milp_bound_basis="exact model, replay tails"``); the separators' bound holds for both
prices (a node that saves what a replay needs runs in it either way); the HiGHS program prices whole
replays, which a plan's tails undercut, so there it only proposes plans (its plan, the seeds and
``auto``'s plan, which seeds this mode, are priced as they run) and its bound is not used. Decision:
no separate tails program: where the lattice does not close, the separators' bound is the larger
on the zoo (``benchmarks/results/cpu/milp_gaps/separators/``).

Complexity: O(n k) binaries, O((n + e + savers) k) rows; each round is one HiGHS solve
(exponential in the worst case) plus one simulation. Small graphs (tests) close in a few rounds;
on large graphs the proven gap is what the time limit allows.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, proof_words
from ...cost import no_recompute_plan, unoptimised_peak_bytes
from .config import MilpConfig
from .highs import MISSING_HIGHSPY, load_highspy
from .cut_bound import CUTS_BASIS, cut_bound, separator_floor
from .exact import TAILS_BASIS, lattice_peak, lattice_time
from .search import Outcome, Search, best_fit, judge
from ...replay_tail import takes_tails
from .._config import check_budget as _check_budget

__all__ = ["solve_milp", "min_budget_milp", "optimality_gap", "Gap", "MISSING_HIGHSPY"]

logger = logging.getLogger("autoremat.solvers.milp")

CUT_SHARE = 0.25
"""Of ``time_limit_s``, what the separators' bound (:mod:`.cut_bound`) may take where the lattice did not
close (after it, before the program)."""

_K = 12  # k when not given: 12, or the most segments of a seed plan (see the module docstring)
_known: weakref.WeakKeyDictionary[Graph, list[Plan]] = weakref.WeakKeyDictionary()


def _config(config: dict[str, Any] | None) -> dict[str, Any]:
    cfg = MilpConfig.parse(config).as_dict()  # an unknown option is a ValueError naming the accepted ones
    k = cfg["k"]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k={k!r} must be None or an int >= 1 (the most segments a plan may have)")
    t = cfg["time_limit_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or not math.isfinite(t):
        raise ValueError(f"time_limit_s={t!r} must be a positive number of seconds")
    if cfg["objective"] not in ("time", "memory"):
        raise ValueError(f"objective={cfg['objective']!r} is not supported; expected 'time' or 'memory'")
    th = cfg["threads"]
    if th is not None and (isinstance(th, bool) or not isinstance(th, int) or th < 1):
        raise ValueError(f"threads={th!r} must be None or an int >= 1")
    if not isinstance(cfg["tails"], bool):
        raise ValueError(f"tails={cfg['tails']!r} must be True (extra time as plans run, replays to their tails) "
                         "or False (replays whole)")
    cfg["seeds"] = bool(cfg["seeds"])
    return cfg


def _seeds(graph: Graph, budget: int | None, use: bool, tails: bool = False) -> list[Plan]:
    """Plans of other solvers at ``budget`` (their least budget when ``None``), and known ones;
    ``tails`` (priced as plans run): ``auto``'s too, which is chosen by that price."""
    out = [Plan(list(p.segments)) for p in _known.get(graph, ())]
    out.append(no_recompute_plan(graph))
    if not use:
        return out
    from ..chen import solve_chen
    from ..kusumoto import min_budget, solve_dp_approx, solve_dp_exact

    from ..reforward import solve_reforward
    from ..xla_greedy import solve_xla_greedy

    exact = {"fallback": False}  # dp-exact only where it runs on every lower set (else a ValueError)
    for name, fn, cfg in (("chen", solve_chen, None), ("dp-approx", solve_dp_approx, None),
                          ("dp-exact", solve_dp_exact, exact), ("xla-greedy", solve_xla_greedy, None),
                          ("reforward", solve_reforward, None)):
        try:
            b = budget
            if b is None:
                b = min_budget(graph, name, config=cfg) if name.startswith("dp-") else _least(graph, fn)
            out.append(Plan(list(fn(graph, b, config=cfg).segments)))
        except InfeasibleBudgetError:
            continue
        except (ValueError, RuntimeError) as err:  # a seed is optional: say why it is missing
            logger.info("milp: no %s seed (%s)", name, err)
    if tails and budget is not None:
        from .. import _solve_bytes

        try:
            out.append(Plan(list(_solve_bytes(graph, budget, "auto", None, {}).segments)))
        except InfeasibleBudgetError:
            pass
    return out


def _least(graph: Graph, fn: Any) -> int:
    try:
        fn(graph, 0, config=None)
    except InfeasibleBudgetError as err:
        if err.min_budget_bytes is not None:
            return err.min_budget_bytes
    return 0


_MODELS = {"exact model": "lattice search over the exact model (cost.segment_replay), the plan checked by simulate",
           "program": "relaxation of the simulator's peak, every plan checked by simulate (no-good cuts)",
           CUTS_BASIS: "bound from the simulator's levels at the backward's separators (milp.cut_bound); "
                       "every plan checked by simulate",
           TAILS_BASIS: "lattice search over the exact model with replays priced to their tails, the plan checked "
                        "by simulate"}


def _stamp(plan: Plan, out: Outcome, cfg: dict[str, Any], budget: int | None) -> Plan:
    plan = Plan(list(plan.segments), solver="milp")
    plan.options.update({
        "objective": cfg["objective"],
        "k": out.k,
        "time_limit_s": float(cfg["time_limit_s"]),
        "milp_status": out.status,
        "optimality_gap": out.gap,
        "milp_rounds": out.rounds,
        "milp_cuts": out.cuts,
        "milp_seconds": round(out.seconds, 3),
        "milp_bound_basis": out.basis,
        "model": _MODELS.get(out.basis, _MODELS["program"]),
    })
    if cfg["objective"] == "time":
        plan.options["tails"] = cfg["tails"]
        plan.options["optimum_bound_s"] = out.bound
        plan.options["extra_time_as_run_s" if cfg["tails"] else "extra_time_no_tails_s"] = out.cost
    else:
        plan.options["least_peak_bound_bytes"] = out.bound
        plan.options["peak_bytes"] = out.cost
    return plan


def solve_milp(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | None = None) -> Plan:
    """The least-extra-time plan of at most ``k`` segments within ``budget_bytes`` (see the module docstring)."""
    budget = _check_budget(budget_bytes)
    cfg = _config(config)
    load_highspy()
    n = len(graph)
    if n == 0 or (cfg["objective"] == "time" and unoptimised_peak_bytes(graph) <= budget):
        out = Outcome(no_recompute_plan(graph), 0.0, 0.0, "optimal", k=min(cfg["k"] or _K, max(n, 1)))
        return _stamp(out.plan, out, cfg, budget)  # type: ignore[arg-type]
    if cfg["objective"] == "memory":
        out = _least_peak(graph, cfg)
        if out.plan is None or out.cost is None or out.cost > budget:
            raise InfeasibleBudgetError(budget, None if out.cost is None else int(out.cost), solver="milp")
        return _stamp(out.plan, out, cfg, budget)
    seeds = _seeds(graph, budget, cfg["seeds"], cfg["tails"])
    out = _least_time(graph, budget, cfg, seeds)
    if out.plan is None:
        if out.status == "infeasible":
            least = _least_peak(graph, {**cfg, "time_limit_s": max(1.0, float(cfg["time_limit_s"]) / 2)})
            need = least.cost if least.cost is not None else least.bound
            raise InfeasibleBudgetError(budget, None if not math.isfinite(need) else int(need), solver="milp")
        raise RuntimeError(f"milp found no plan within {budget} bytes in time_limit_s={cfg['time_limit_s']} "
                           f"({out.rounds} rounds, {out.cuts} plans cut; the budget is not proven infeasible); "
                           "raise time_limit_s or the budget, or use solver='dp-approx'")
    logger.info("milp: %s after %d rounds (%.1f s): extra time %.6g s, bound %.6g s, gap %.3g %%", out.status,
                out.rounds, out.seconds, out.cost, out.bound, 100 * (out.gap or 0.0))
    return _stamp(out.plan, out, cfg, budget)


def _least_time(graph: Graph, budget: int, cfg: dict[str, Any], seeds: list[Plan]) -> Outcome:
    """The lattice first (``k`` not given, few lower sets: :mod:`.exact`); where it does not close, the
    separators' bound (:mod:`.cut_bound`), then the program in the time left; the largest bound is kept.
    Priced as plans run (``tails``, :func:`_as_run`) the program only proposes plans."""
    limit = float(cfg["time_limit_s"])
    tails = bool(cfg["tails"]) and takes_tails(graph)
    lat = lattice_time(graph, budget, limit, seeds, tails=tails) if cfg["k"] is None else None
    if lat is not None and (lat.status == "infeasible" or (lat.status == "optimal" and lat.plan is not None)):
        return lat
    spent = 0.0 if lat is None else lat.seconds
    cut = cut_bound(graph, budget, max(min(CUT_SHARE * limit, limit - spent), 0.05 * limit), threads=cfg["threads"])
    spent += cut.seconds
    if cut.bound_s == math.inf:  # some separator's level is over the budget in every plan
        return Outcome(None, None, math.inf, "infeasible", k=len(graph), seconds=spent, basis=CUTS_BASIS)
    if lat is not None:
        seeds = seeds + ([lat.plan] if lat.plan is not None else [])
    search = Search(graph, _k(cfg["k"], seeds, len(graph)), "time", cfg["threads"])
    out = search.minimise_time(budget, max(limit - spent, 0.05 * limit), seeds)
    out.seconds += spent
    if tails:
        out = _as_run(graph, budget, out, seeds)
    out.raise_bound(cut.bound_s, CUTS_BASIS, rel=1e-6)
    if lat is not None and lat.basis != "program":  # the lattice stopped at its limit
        out.raise_bound(lat.bound, lat.basis, rel=1e-6)
    return out


def _as_run(graph: Graph, budget: int, out: Outcome, seeds: list[Plan]) -> Outcome:
    """``out`` priced as the plans run: the least extra time with replay tails (:func:`.search.judge`)
    of its plan and ``seeds`` (those within ``budget`` and of at most ``out.k`` segments, as the
    program takes them), and no bound yet: the program's is over whole replays, which a plan's tails
    undercut (the caller raises it with the separators' and the tails lattice's, which hold as plans run)."""
    best, cost = best_fit(graph, ([out.plan] if out.plan is not None else []) + seeds, budget, tails=True, k=out.k)
    status = "infeasible" if best is None and out.status == "infeasible" else "time_limit"
    return Outcome(best, None if best is None else cost, math.inf if status == "infeasible" else 0.0, status,
                   out.rounds, out.cuts, out.seconds, out.k, basis=CUTS_BASIS)


def _k(k: int | None, seeds: list[Plan], n: int) -> int:
    """``k`` as given, else 12 or the most segments of a seed plan (so that every seed is in the
    program's space and the answer is never worse than theirs), at most ``n``."""
    if k is None:
        k = max([_K, *(len(p.segments) for p in seeds)])
    return max(1, min(k, n))


def _least_peak(graph: Graph, cfg: dict[str, Any]) -> Outcome:
    limit = float(cfg["time_limit_s"])
    lat = lattice_peak(graph, limit) if cfg["k"] is None else None
    if lat is not None and lat.status == "optimal" and lat.plan is not None:
        _known.setdefault(graph, []).append(lat.plan)
        return lat
    seeds = _seeds(graph, None, cfg["seeds"]) + ([lat.plan] if lat is not None and lat.plan is not None else [])
    search = Search(graph, _k(cfg["k"], seeds, len(graph)), "memory", cfg["threads"])
    out = search.minimise_peak(limit if lat is None else max(limit - lat.seconds, 0.05 * limit), seeds)
    if lat is not None and lat.basis == "exact model":
        out.raise_bound(lat.bound, lat.basis)
    out.raise_bound(float(separator_floor(graph)), CUTS_BASIS)  # what every plan holds at some separator
    if out.plan is not None:
        _known.setdefault(graph, []).append(out.plan)
    return out


def min_budget_milp(graph: Graph, *, config: dict[str, Any] | None = None) -> int:
    """The least simulated step peak of a plan of at most ``k`` segments that the memory-centric
    search finds within ``time_limit_s`` (proven least when its gap is 0; the plan is remembered,
    so ``solve_milp(graph, b)`` finds a plan for every ``b`` at or above it)."""
    cfg = _config(config)
    load_highspy()
    if len(graph) == 0:
        return 0
    out = _least_peak(graph, cfg)
    if out.cost is None:
        raise RuntimeError("milp found no plan at all within time_limit_s; raise it")
    logger.info("milp: least budget %d bytes (%s, bound %s bytes, gap %.3g %%)", int(out.cost), out.status,
                out.bound, 100 * (out.gap or 0.0))
    return int(out.cost)


@dataclass
class Gap:
    """A plan's extra time (without replay tails) beside the proven optimum at its budget."""

    extra_time_s: float
    bound_s: float
    gap: float
    proven_optimal: bool
    optimum_plan: Plan | None
    optimum_extra_time_s: float | None
    k: int = 0
    """The most segments of the plans the bound covers."""
    basis: str = "program"
    """What the proof is over: ``"program"`` (the simulator's relaxation), ``"separators"`` (the simulator's
    levels where every plan meets, :mod:`.cut_bound`), ``"exact model"`` (the lattice search,
    :mod:`.exact`) or ``"exact model, replay tails"`` (the same, priced as plans run)."""
    tails: bool = False
    """Extra times as the plans run (recomputed segments replayed to their tails), not replayed whole."""

    def describe(self, as_run_s: float | None = None) -> str:
        """E.g. "extra time 0.41 s, within 3 % of the optimum (proven)". ``as_run_s``: the plan's
        extra time as it runs, with its replay tails, where that differs (said beside: the gap is
        over whole replays, the terms ``milp`` proves in unless ``tails``)."""
        proof = proof_words(self.basis)
        what = f"extra time {self.extra_time_s:.4g} s"
        if self.tails:
            what += " as it runs (replays to their tails)"
        elif as_run_s is not None and abs(as_run_s - self.extra_time_s) > 1e-9 * max(abs(self.extra_time_s), 1e-30):
            what += f" replaying segments whole ({as_run_s:.4g} s as it runs, with its replay tails)"
        if self.gap <= 1e-9:
            return f"{what}, optimal ({proof})"
        where = "the optimum" if self.proven_optimal else "the best bound on the optimum"
        return f"{what}, within {100 * self.gap:.3g} % of {where} ({proof})"


def optimality_gap(graph: Graph, plan: Plan, budget_bytes: int, *, time_limit_s: float = 60.0,
                   k: int | None = None, threads: int | None = None, tails: bool = False) -> Gap:
    """How far ``plan``'s extra time is from the least over canonical strategies of at most ``k``
    segments (default: 12, or the most segments of ``plan`` and the seed plans) within
    ``budget_bytes``: replayed whole (the papers' price), or as the plans run (``tails``: each
    recomputed segment replayed to its tail, on fx graphs; the bound from the separators and the
    lattice priced so, where it runs: :func:`solve_milp`'s ``tails``)."""
    budget = _check_budget(budget_bytes)
    cfg = _config({"k": k, "time_limit_s": time_limit_s, "threads": threads, "tails": tails})
    load_highspy()  # the program may be needed (the lattice alone does not prove every graph)
    _, extra = judge(graph, plan, tails=tails)
    if extra <= 0:
        return Gap(0.0, 0.0, 0.0, True, plan, 0.0, len(plan.segments), tails=tails)
    seeds = [Plan(list(plan.segments)), *_seeds(graph, budget, True, tails)]
    if k is not None:
        cfg["k"] = max(k, len(plan.segments))
    out = _least_time(graph, budget, cfg, seeds)
    bound = min(max(out.bound, 0.0), extra)
    gap = 0.0 if extra <= 0 else (extra - bound) / extra
    return Gap(extra, bound, gap, out.status == "optimal", out.plan, out.cost, out.k, out.basis, tails=tails)
