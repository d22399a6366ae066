"""``"offload-dag"``: which stored tensors live in host memory, on any graph (issue 22).

Problem: given a plan's segments (by default: nothing recomputed), choose the storages it keeps
for backward to offload (``Plan.offload``: saved activations, and inputs of recomputed segments —
"offloaded checkpoints") and where the forward waits for their copies (``Plan.offload_waits``), so
that the step peak :func:`autoremat.cost.simulate` predicts fits the budget at the least predicted
step time (stalls included). On a chain this is Beaumont et al.'s Problem 1, strongly NP-complete
(Theorem 1 of [1]); the transfer model is theirs (:mod:`autoremat.cost.offload_link`).

Paper: .. [1] O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Optimal GPU-CPU Offloading Strategies
   for Deep Neural Network Training", hal-02316266, 2019 (GREEDY's eager prefix, §4.2, is one of
   the orders tried here).

Method (a heuristic on the graph itself, no chain; exact on small candidate sets). Every set ``S``
is judged by the simulator at each prefetch depth of ``prefetch_depths`` (``Plan.offload_prefetch_depth``:
how many storages backward fetches ahead of their first use; deeper hides more of each copy
behind compute and reserves more memory), as it is and with the forward waits the simulator derives at the
budget (``offload_wait_limit_bytes``: before a node that would lift the level above the budget,
wait for the fewest pending copies whose completion frees enough); where neither fits, also with
those derived at 0 (wait for every copy as soon as that frees memory), so that the least peak a
set reaches is reached at every larger budget. A set is first simulated in its *least-memory
form* (the shallowest depth, waiting for every copy: :meth:`OffloadSearch.floor`); where that does
not fit, no other form is (its peak is the least of all forms: property test on seeded random
graphs), so a set that cannot fit costs one simulation.

1. *Not binding*: the base plan fits, it is returned without offloads.
2. *Candidates* ``C``: :func:`~autoremat.plan.offloadable_nodes` of the base plan.
3. *Exhaustive* when ``|C| <= exhaustive_up_to`` (default 8): every subset.
4. Otherwise *prefixes of three orders*: production order (Beaumont's eager order: the earliest
   have the most compute to hide behind); slack order (the compute between the first holder and
   the first backward use over the round trip ``2 |r| / B``, largest first: bytes per second of
   slack); and the storages whose round trip fits that window, largest first. Prefix lengths on an
   even grid (``prefix_grid``), then every length just below the first that fits or, where none
   fits on the grid, around the grid point with the least peak (neither peak nor stalls are monotone in the length: more
   copies keep the links busy, and a copy in flight holds its memory).
5. *Seeds*: the offload sets of Beaumont's chain solvers (``chain_seeds``, default GREEDY and
   DYNPROG) where they find one, judged the same way: the result is never predicted slower than
   theirs, nor is the least budget met higher. Not run below
   :func:`~autoremat.cost.repeated.forward_floor_bytes` (no plan meets such a budget).
6. *Prune*: from the fastest fitting set, members are dropped one at a time (largest first)
   while the plan still fits and is no slower (fewer copies free the links), each trial judged at
   the set's own prefetch depth (the pruned set at every depth).
7. The fitting plan with the least predicted step time wins (then fewer offloaded bytes).
8. *The nodes' own saved tensors* (``saved_units``, default on; ``Plan.offload_saved``: a module
   call's internal activations, one unit each, :mod:`autoremat.plan_offload`; a block captured op by
   op: all its ops save, :mod:`autoremat.region_units`): where the base plan
   has such candidates, steps 3-6 run again with them beside the storages (each unit in the
   production order right after its node), on the same judged sets; steps 3-6 without them ran
   first, unchanged, so the plan is never predicted slower than without them (a wider search).
   Infeasible: :class:`~autoremat.errors.InfeasibleBudgetError` with the least simulated peak
   of every plan judged.

Options: ``bandwidth_bytes_per_s``, ``offload`` (True, False, ``"auto"``: as the chain offload
solvers, :func:`~autoremat.solvers.beaumont.offload_flag`), ``prefix_grid``,
``exhaustive_up_to``, ``chain_seeds``, ``waits`` (judge sets with derived forward waits too),
``prefetch_depths`` (default ``(1, 2, 4)``).

Time: O(n) per simulation; at most ``3 d (3 g + 4 step + |C|)`` simulations for ``g =
prefix_grid`` and ``d`` depths (plus ``3 d 2^|C|`` when exhaustive) and the chain solvers' own
time. Every simulation is memoised per solve (:mod:`.offload_sims`; the chain seeds share it); the
probes of :func:`~autoremat.solvers.min_budget` share one memo and stop at the first plan that
fits (:func:`dag_meets`). Space O(n) plus the memoised simulations' results. Limitations: the set
search is a heuristic; waits are derived by one rule (wait
for the fewest copies at the node that would exceed the budget), not searched; the prefetch depth
is one per plan (not a schedule that prefetches as early as memory allows, the paper's no-wait
policy). How far a plan is from any offload plan's best: :mod:`autoremat.solvers.evaluation.offload_bound`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..cost import no_recompute_plan
from ..cost.repeated import forward_floor_bytes
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, offloadable_nodes, region_stop
from ..plan_offload import saved_unit, saved_unit_nodes, unit_bytes
from ..region_units import unit_span
from ._config import SolverConfig
from .offload_sims import OffloadSims

__all__ = ["solve_offload_dag", "OffloadDagConfig", "OffloadSearch", "slack_windows", "offload_candidates"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadDagConfig(SolverConfig):
    """Options of ``offload-dag`` (see the module docstring)."""

    solver: ClassVar[str] = "offload-dag"
    bandwidth_bytes_per_s: float | None = field(default=None, metadata={
        "help": "host<->device bandwidth per direction (default graph.meta's, else the simulator's default)"})
    offload: bool | str | None = field(default="auto", metadata={
        "help": "True, False, or 'auto' (offload on CUDA and meta captures)"})
    prefix_grid: int = field(default=32, metadata={"help": "prefix lengths simulated per candidate order"})
    exhaustive_up_to: int = field(default=8, metadata={
        "help": "try every subset when there are at most this many candidates"})
    chain_seeds: tuple[str, ...] = field(default=("offload-greedy", "offload-dp"), metadata={
        "help": "Beaumont chain solvers whose offload sets are judged too"})
    waits: bool = field(default=True, metadata={"help": "judge every set with derived forward waits too"})
    prefetch_depths: tuple[int, ...] = field(default=(1, 2, 4), metadata={
        "help": "prefetch depths (storages fetched ahead of their first backward use) every set is judged at"})
    saved_units: bool = field(default=True, metadata={
        "help": "also offload module calls' own saved tensors, one unit per call (Plan.offload_saved)"})


class FitFound(Exception):
    """An :class:`OffloadSearch` with ``stop_at_fit`` simulated a plan within its budget."""


@dataclass
class _Judged:
    peak: int
    time: float
    nodes: tuple[int, ...]
    waits: dict[int, int]
    offloaded: int
    depth: int = 1


class OffloadSearch:
    """Offload sets on one base plan, judged by the simulator at one budget (memoised)."""

    def __init__(self, graph: Graph, base: Plan, budget: int, bandwidth: float, waits: bool = True,
                 depths: Sequence[int] = (1,), sims: OffloadSims | None = None, stop_at_fit: bool = False) -> None:
        self.graph, self.base, self.budget, self.bandwidth, self.with_waits = graph, base, budget, bandwidth, waits
        self.depths = tuple(sorted({max(1, int(d)) for d in depths} or {1}))
        self.seen: dict[tuple[int, ...], _Judged] = {}
        self.least_peak: int | None = None
        self.sims = sims if sims is not None and sims.matches(graph, base, bandwidth) else \
            OffloadSims(graph, base, bandwidth)
        """The simulations, memoised (:mod:`.offload_sims`: shared by the solves of one ``min_budget``)."""
        self.stop_at_fit = stop_at_fit
        """Raise :class:`FitFound` at the first simulation that fits (all a least-budget search asks)."""

    def judge(self, nodes: Iterable[int]) -> _Judged:
        """The better (fits first, then faster) of ``nodes`` without waits, with the waits derived
        at the budget and, when neither fits, with those derived at 0 (wait for every copy), at
        each prefetch depth of ``depths``. A set is first judged in its least-memory form
        (:meth:`floor`); where that does not fit, no other form is judged (it would not fit either:
        property-tested on seeded random graphs) and the set's peak is the floor's."""
        key = tuple(sorted(set(nodes)))
        if key in self.seen:
            return self.seen[key]
        best = self._judge_at(key, self.depths if key else (1,))
        self.seen[key] = best
        return best

    def _judge_at(self, key: tuple[int, ...], depths: Sequence[int]) -> _Judged:
        """:meth:`judge`'s forms of ``key`` at ``depths`` (the floor first), not memoised."""
        floor = self.floor(key) if key else None
        if floor is not None and floor.peak > self.budget:
            return floor
        # (no waits) is not simulated with waits on: where it fits, the waits derived at the budget are
        # none and that simulation is the same; where it does not, the budget's waits come next anyway
        options = [self.budget, 0] if (self.with_waits and key) else [None]
        best: _Judged | None = floor
        for depth in depths:
            fits_here = False
            for limit in options:
                if limit is not None and fits_here:
                    break  # fits without (more) waiting: the budget's waits are none, and waiting longer only costs
                if floor is not None and (depth, limit) == self._floor_form:
                    j = floor
                else:
                    j = self._simulate(key, depth, limit)
                fits_here = fits_here or j.peak <= self.budget
                if best is None or self._better(j, best):
                    best = j
        assert best is not None
        return best

    @property
    def _floor_form(self) -> tuple[int, int | None]:
        return self.depths[0], (0 if self.with_waits else None)

    def floor(self, key: tuple[int, ...]) -> _Judged:
        """``key`` in its least-memory form: the shallowest prefetch depth, and (with waits) the
        forward waiting for every copy that frees memory (limit 0). Its peak is the least of every
        form :meth:`judge` tries (tests/solvers/test_offload_dag.py checks it on random graphs)."""
        depth, limit = self._floor_form
        return self._simulate(key, depth, limit)

    def _simulate(self, key: tuple[int, ...], depth: int, limit: int | None) -> _Judged:
        sim = self.sims.run(key, depth, limit)
        j = _Judged(sim.peak_bytes, sim.extra_time_s, key, sim.offload_waits if limit is not None else {},
                    sim.offloaded_bytes, depth)
        self.least_peak = j.peak if self.least_peak is None else min(self.least_peak, j.peak)
        if self.stop_at_fit and j.peak <= self.budget:
            raise FitFound()
        return j

    def _better(self, a: _Judged, b: _Judged) -> bool:
        fa, fb = a.peak <= self.budget, b.peak <= self.budget
        if fa != fb:
            return fa
        if fa:
            return (a.time, a.offloaded, len(a.waits), a.depth) < (b.time, b.offloaded, len(b.waits), b.depth)
        return (a.peak, a.depth) < (b.peak, b.depth)

    def _plan(self, units: tuple[int, ...], waits: dict[int, int], depth: int = 1) -> Plan:
        """The base plan offloading ``units`` (node outputs, and ``-1 - v``: node ``v``'s own saved tensors)."""
        return self.sims.plan(units, waits, depth)

    def best(self) -> _Judged | None:
        fits = [j for j in self.seen.values() if j.peak <= self.budget]
        return min(fits, key=lambda j: (j.time, j.offloaded, len(j.waits), j.depth, j.nodes)) if fits else None

    def plan_of(self, j: _Judged) -> Plan:
        return self._plan(j.nodes, j.waits, j.depth)

    # ------------------------------------------------------------------ searches
    def prefixes(self, order: Sequence[int], grid: int) -> None:
        """Prefixes of ``order`` on an even grid of lengths, then every length just below the first
        that fits (shorter prefixes offload less) or, where none fits, around the least peak (step
        4 of the module docstring)."""
        n = len(order)
        if not n:
            return
        points = max(1, min(n, grid))
        step = max(1, n // points)
        lengths = sorted({min(n, 1 + i * step) for i in range(points)} | {n})
        peaks = {k: self.judge(order[:k]).peak for k in lengths}
        first_fit = next((k for k in lengths if peaks[k] <= self.budget), None)
        if first_fit is None:
            best_k = min(lengths, key=lambda k: peaks[k])
            around = set(range(max(1, best_k - step), min(n, best_k + step) + 1))
        else:  # (the least peak's neighbours offload more than the first fit: slower, as a rule)
            around = set(range(max(1, first_fit - step), first_fit))
        for k in sorted(around - set(lengths)):
            self.judge(order[:k])

    def exhaustive(self, candidates: Sequence[int]) -> None:
        for k in range(len(candidates) + 1):
            for subset in itertools.combinations(candidates, k):
                self.judge(subset)

    def prune(self) -> None:
        """Drop members of the fastest fitting set, largest first, while it fits and is no slower;
        each trial is judged at that set's prefetch depth only (the pruned set then at every depth)."""
        cur = self.best()
        if cur is None:
            return
        nodes = list(cur.nodes)
        for r in sorted(cur.nodes, key=lambda u: (-unit_bytes(self.graph, u), u)):
            trial = tuple(v for v in nodes if v != r)
            j = self.seen.get(trial) or self._judge_at(trial, (cur.depth,) if trial else (1,))
            if j.peak <= self.budget and j.time <= cur.time:
                nodes, cur = list(trial), j
        self.judge(nodes)


def slack_windows(graph: Graph, plan: Plan) -> dict[int, float]:
    """Per offload candidate of ``plan``: the compute time (forward and backward, recomputation
    left out) between its first holder taking it and its first backward use — the time its two
    copies can hide behind (a ranking for step 4, not a cost model)."""
    order = [v for seg in plan.segments for v in seg.nodes]
    pos = {v: i for i, v in enumerate(order)}
    fwd_end, acc = [], 0.0
    for v in order:
        acc += graph.node(v)["time_s"]
        fwd_end.append(acc)
    total_fwd = acc
    bwd_after = [0.0] * (len(order) + 1)  # backward time of the nodes after each position
    for i in range(len(order) - 1, -1, -1):
        bwd_after[i] = bwd_after[i + 1] + graph.node(order[i])["bwd_time_s"]
    keep: dict[int, int] = {}
    use: dict[int, int] = {}
    recomputed = plan.recomputed_nodes
    for w in order:
        d = graph.node(w)
        if w not in recomputed and d["requires_grad"]:
            for u in d["saves"]:
                r = graph.root(u)
                keep[r] = min(keep.get(r, pos[w]), pos[w])
                use[r] = max(use.get(r, pos[w]), pos[w])
    for seg in plan.segments:
        stop = region_stop(graph, seg)
        if stop >= 0:
            members = set(seg.nodes)
            for u in {u for v in seg.nodes for u in graph.pred(v) if u not in members}:
                r = graph.root(u)
                first = pos[seg.nodes[0]] - 1
                keep[r] = min(keep.get(r, first), first)
                use[r] = max(use.get(r, pos[stop]), pos[stop])
    for v in saved_unit_nodes(graph, plan):  # its own saved tensors (its block's): from its forward to its backward
        last, first_use = unit_span(graph, saved_unit(v))
        keep[saved_unit(v)], use[saved_unit(v)] = pos[last], pos[first_use]
    return {r: total_fwd - (fwd_end[keep[r]] if keep[r] >= 0 else 0.0) + bwd_after[use[r] + 1]
            for r in offload_candidates(graph, plan) if r in keep}


def offload_candidates(graph: Graph, plan: Plan, units: bool = True) -> list[int]:
    """The units ``plan`` may offload in production order: the storages it keeps for backward
    (:func:`~autoremat.plan.offloadable_nodes`) and, with ``units``, the own saved tensors of its
    nodes (``-1 - v``: :func:`~autoremat.plan.saved_unit_nodes`), each right after its node (a
    block's, :mod:`autoremat.region_units`: right after the block's last node)."""
    cands = list(offloadable_nodes(graph, plan))
    if units:
        cands += [saved_unit(v) for v in saved_unit_nodes(graph, plan)]
    return sorted(cands, key=lambda u: (unit_span(graph, u)[0], u < 0))


def candidate_orders(graph: Graph, plan: Plan, bandwidth: float, units: bool = False) -> list[list[int]]:
    """Step 4's orders of the candidates: production, slack, hideable by size."""
    cands = offload_candidates(graph, plan, units)
    window = slack_windows(graph, plan)
    size = {r: unit_bytes(graph, r) for r in cands}
    trip = {r: 2 * size[r] / bandwidth for r in cands}
    slack = sorted(cands, key=lambda r: (-(window.get(r, 0.0) / max(trip[r], 1e-30)), r))
    hideable = sorted((r for r in cands if trip[r] <= window.get(r, 0.0)), key=lambda r: (-size[r], r))
    return [cands, slack, hideable]


def _seeds_judged(search: OffloadSearch, seeds: Sequence[Sequence[int]], units: bool = False) -> None:
    """Step 5: each seed's members among the candidates (``units``: those of step 8) judged."""
    if seeds:
        cands = set(offload_candidates(search.graph, search.base, units))
        for seed in seeds:
            search.judge([v for v in seed if v in cands])


def search_offloads(search: OffloadSearch, grid: int, exhaustive_up_to: int,
                    seeds: Sequence[Sequence[int]] = (), prune: bool = True, units: bool = False) -> None:
    """Steps 3-6 of the module docstring on ``search``'s base plan (``prune=False``: 3-5 only;
    the caller prunes the search it keeps, :meth:`OffloadSearch.prune`); ``units``: the
    candidates include the nodes' own saved tensors (step 8)."""
    graph, base = search.graph, search.base
    cands = offload_candidates(graph, base, units)
    search.judge(())
    if len(cands) <= exhaustive_up_to:
        search.exhaustive(cands)
    else:
        for order in candidate_orders(graph, base, search.bandwidth, units):
            search.prefixes(order, grid)
    _seeds_judged(search, seeds, units)
    if prune:
        search.prune()


def chain_seed_sets(graph: Graph, budget: int, names: Sequence[str], cfg: dict[str, Any],
                    sims: OffloadSims | None = None) -> list[tuple[int, ...]]:
    """The offload sets Beaumont's chain solvers find at ``budget`` (those that find one); ``sims``:
    their simulations, shared (the solvers scan the same prefixes; :mod:`.offload_sims`)."""
    from .beaumont import solve_chain_offload

    out: list[tuple[int, ...]] = []
    if budget < forward_floor_bytes(graph):  # no plan meets it (the chain solvers' prefix scans would tell slowly)
        return out
    for name in names:
        try:
            plan = solve_chain_offload(graph, budget, name, {"bandwidth_bytes_per_s": cfg["bandwidth_bytes_per_s"],
                                                             "offload": cfg["offload"]}, sims, seed=True)
        except InfeasibleBudgetError:
            continue
        out.append(tuple(plan.offload))
    return out


def solve_offload_dag(graph: Graph, budget_bytes: int, *,
                      config: dict[str, Any] | OffloadDagConfig | None = None) -> Plan:
    """Offloads on the graph without recomputation (see the module docstring)."""
    search, best, opts = _search_dag(graph, int(budget_bytes), OffloadDagConfig.parse(config).as_dict(), None)
    return _finish(search, best, "offload-dag", opts)


def dag_meets(graph: Graph, budget: int, cfg: dict[str, Any], sims: OffloadSims) -> bool:
    """Whether :func:`solve_offload_dag` meets ``budget`` (``cfg`` parsed), raising its
    :class:`~autoremat.errors.InfeasibleBudgetError` where not: the same search, its simulations in
    ``sims``, stopped at the first plan that fits (:func:`.offload_sims.least_budget_run`)."""
    try:
        _search_dag(graph, int(budget), cfg, sims, stop_at_fit=True)
    except FitFound:
        pass
    return True


def _search_dag(graph: Graph, budget: int, cfg: dict[str, Any], sims: OffloadSims | None,
                stop_at_fit: bool = False) -> tuple[OffloadSearch, _Judged, dict[str, Any]]:
    """:func:`solve_offload_dag`'s search: the search, its plan and the plan's options."""
    from .beaumont import offload_bandwidth, offload_flag, offload_refused

    for key in ("prefix_grid", "exhaustive_up_to"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < 0:
            raise ValueError(f"{key}={cfg[key]!r} must be an int >= 0")
    bandwidth = offload_bandwidth(graph, cfg)
    allow = offload_flag(graph, cfg)
    base = sims.base if sims is not None else no_recompute_plan(graph)
    depths = cfg["prefetch_depths"]
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths):
        raise ValueError(f"prefetch_depths={depths!r} must be a non-empty tuple of ints >= 1")
    search = OffloadSearch(graph, base, budget, bandwidth, waits=bool(cfg["waits"]), depths=depths, sims=sims,
                           stop_at_fit=stop_at_fit)
    vanilla = search.judge(())
    opts: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "offload_allowed": allow}
    if vanilla.peak <= budget:
        return search, vanilla, opts
    if not allow:
        raise offload_refused(graph, cfg, budget, vanilla.peak, "offload-dag")
    grid, exhaustive = int(cfg["prefix_grid"]), int(cfg["exhaustive_up_to"])
    units = bool(cfg["saved_units"]) and bool(saved_unit_nodes(graph, base))
    if stop_at_fit:  # whether any set fits does not depend on the order sets are judged in: the seeds last
        search_offloads(search, grid, exhaustive, prune=False)
        if units:
            search_offloads(search, grid, exhaustive, prune=False, units=True)
        _seeds_judged(search, chain_seed_sets(graph, budget, list(cfg["chain_seeds"]),
                                              {**cfg, "bandwidth_bytes_per_s": bandwidth}, search.sims))
        raise InfeasibleBudgetError(budget, search.least_peak, solver="offload-dag")
    seeds = chain_seed_sets(graph, budget, list(cfg["chain_seeds"]), {**cfg, "bandwidth_bytes_per_s": bandwidth},
                            search.sims)
    search_offloads(search, grid, exhaustive, seeds)
    if units:  # step 8: the same search with the nodes' own saved tensors as candidates too
        search_offloads(search, grid, exhaustive, units=True)
    best = search.best()
    if best is None:
        raise InfeasibleBudgetError(budget, search.least_peak, solver="offload-dag")
    opts.update(candidates=len(offload_candidates(graph, base, units)), judged=len(search.seen))
    return search, best, opts


def _finish(search: OffloadSearch, best: _Judged, name: str, opts: dict[str, Any]) -> Plan:
    plan = search.plan_of(best)
    plan.solver = name
    plan.options = {**plan.options, **opts}
    plan.bandwidth_bytes_per_s = search.bandwidth
    return plan
