"""``"combined"``: one planner for recomputation and offloading under one budget, on any graph.

Problem: among plans that recompute some segments and keep some of what the plan keeps for
backward in host memory (tensors the kept segments save, and the inputs of recomputed segments:
"offloaded checkpoints"), find one whose simulated step peak fits the budget with the least
predicted step time (forward + backward + recomputation + time the step waits for transfers).

Method (a heuristic; the papers solve each half, not the mix — Kusumoto et al. and Beaumont
et al., see :mod:`autoremat.cost.offload_link` for the transfer model):

1. *Recomputation candidates*: the plan without recomputation, and the plans of the base
   recomputation solvers (``bases``, default ``("chen", "dp-approx")`` where registered) solved
   at budgets on a geometric grid from the target up to the unoptimised peak (``budget_steps`` values,
   default 8) — looser budgets recompute less and leave more for offload to absorb; a base that
   cannot meet a budget gives its tightest plan.
2. *Offloaded checkpoints*: plans that cut the graph in topological order wherever the bytes
   saved since the last cut pass a threshold (``checkpoint_steps`` thresholds, default 10; at
   module level every module call on its own) and recompute every part, so that what the step
   keeps is the regions' inputs, which offloading then moves to host memory: the strategy of
   "offloaded gradient checkpointing" (keep only the block inputs, in host memory).
3. *Offload completion* of every candidate that does not fit, cheapest recomputation first (a
   candidate recomputing more than the fastest fitting plan so far is skipped: transfers only add
   time): :class:`~autoremat.solvers.offload_dag.OffloadSearch` over its offload candidates
   (prefixes of production and slack orders on a grid of ``offload_grid`` lengths, the set of
   all region inputs), each set judged with and without forward waits, prefetching one ahead
   (``Plan.offload_prefetch_depth`` 1: deeper prefetches triple the simulations). A candidate
   that does not fit even with every storage it keeps offloaded (in the least-memory form) is
   not searched further: on the H200 graphs of ``benchmarks/results/nvidia-h200/offload_gpu`` that
   set's peak was every search's least, and on seeded random graphs 2 of 3,596 such searches found
   a fitting set (a heuristic). Only the fastest completion is pruned (offload-dag's step 6).
3b. *The nodes' own saved tensors* (``saved_units``, default on; ``Plan.offload_saved``: a module
   call's internal activations as one unit, :mod:`autoremat.plan_offload`): where some candidate
   keeps nodes with such tensors, step 3 runs again with them among the offload candidates of every
   candidate (with recomputation: some calls recomputed, others' internals in host memory). Step 3
   without them ran first, unchanged, so the result is never predicted slower than without them.
4. *Offload alone*: the plan of ``offload-dag`` (with its chain seeds and prefetch depths).
5. The fitting plan with the least predicted step time wins. The plain recomputation plans at
   the target and the offload-only plan are candidates, so the result is never predicted slower
   than the better of recomputation alone (the bases) and offload alone (``offload-dag``).

Offloading only saves memory where there is a separate device: it is considered when the graph
was captured on CUDA or on the meta device (a model of one), or when ``offload=True``; on a
CPU-only capture the planner returns recomputation-only plans (``offload=False`` forces that).

Time: O(candidates · (solve + (3 offload_grid + |C|) · simulate)) with ``candidates <=
1 + budget_steps · |bases| + checkpoint_steps``, usually far fewer completed (step 3's skip);
space O(n). Infeasible budgets raise ``InfeasibleBudgetError`` with the least simulated peak
among all candidates tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, region_stop, saved_unit_nodes, segments_from_lower_sets
from ._config import SolverConfig

__all__ = ["solve_combined", "offload_allowed", "CombinedConfig", "checkpoint_plans"]


@dataclass(frozen=True)
class CombinedConfig(SolverConfig):
    """Options of ``combined`` (see the module docstring)."""

    solver: ClassVar[str] = "combined"
    renamed: ClassVar[dict[str, str]] = {"grid": "budget_steps"}
    bases: tuple[str, ...] = field(default=("chen", "dp-approx"), metadata={
        "help": "recomputation solvers whose plans are completed with offloads (registered ones are used)"})
    budget_steps: int = field(default=8, metadata={
        "help": "budgets per base solver, geometric from the target to the peak"})
    offload_grid: int = field(default=16, metadata={"help": "offload prefix lengths simulated per order and candidate"})
    checkpoint_steps: int = field(default=10, metadata={
        "help": "saved-bytes thresholds of the offloaded-checkpoint plans"})
    bandwidth_bytes_per_s: float | None = field(default=None, metadata={
        "help": "host<->device bandwidth (default graph.meta's, else the simulator's default)"})
    offload: bool | str = field(default="auto", metadata={
        "help": "True, False, or 'auto' (offload on CUDA and meta captures)"})
    saved_units: bool = field(default=True, metadata={
        "help": "also offload module calls' own saved tensors, one unit per call (Plan.offload_saved)"})


def offload_allowed(graph: Graph, config: dict[str, Any]) -> bool:
    """Whether offloading can save device memory for this graph (see the module docstring)."""
    if "offload" in config and config["offload"] != "auto":
        return bool(config["offload"])
    device = str(graph.meta.get("device", ""))
    return device.startswith("cuda") or device == "meta"


def checkpoint_plans(graph: Graph, steps: int) -> list[Plan]:
    """Step 2's plans: the graph cut in topological order wherever the bytes its nodes save since
    the last cut pass a threshold (``steps`` thresholds, geometric from the largest single node's
    saved bytes to half the total; Chen et al.'s greedy rule, at any cut, not only where one
    tensor is handed on), every part but the last recomputed; at module level, every module call
    alone."""
    n = len(graph)
    if n < 2 or steps < 1:
        return []
    if graph.meta.get("mode") == "module":
        return [Plan(segments_from_lower_sets(graph, [range(v + 1) for v in range(n)]), solver="checkpoints")]
    saved = [int(graph.node(v)["saved_bytes"]) for v in graph.nodes]
    lo, hi = max(max(saved), 1), max(sum(saved) / 2, 1)
    out, seen = [], set()
    for i in range(steps):
        threshold = lo * (hi / lo) ** (i / max(1, steps - 1)) if hi > lo else lo
        ends, acc = [], 0
        for v in range(n - 1):
            acc += saved[v]
            if acc > threshold:
                ends.append(v)
                acc = 0
        if not ends or tuple(ends) in seen:
            continue
        seen.add(tuple(ends))
        lowers = [range(e + 1) for e in ends] + [range(n)]
        out.append(Plan(segments_from_lower_sets(graph, lowers), solver="checkpoints",
                        options={"checkpoint_threshold_bytes": int(threshold)}))
    return out


def _recompute_candidates(graph: Graph, budget_bytes: int, cfg: dict[str, Any]) -> list[Plan]:
    """Step 1's plans, distinct by their segments."""
    from . import SOLVERS, bare_solver  # the registry imports this module

    vanilla = unoptimised_peak_bytes(graph)
    steps = int(cfg["budget_steps"])
    targets = [budget_bytes] if vanilla <= budget_bytes else [
        int(budget_bytes * (vanilla / max(budget_bytes, 1)) ** (i / max(1, steps - 1))) for i in range(steps)]
    candidates = [no_recompute_plan(graph)]
    seen: set[tuple] = {tuple((s.nodes, s.recompute) for s in candidates[0].segments)}
    for base in (b for b in cfg["bases"] if b in SOLVERS):
        for b in targets:
            try:
                p = bare_solver(base)(graph, b, config={})
            except InfeasibleBudgetError as err:  # keep the base's tightest plan as a candidate
                if err.min_budget_bytes is None:
                    continue
                try:
                    p = bare_solver(base)(graph, err.min_budget_bytes, config={})
                except InfeasibleBudgetError:
                    continue
            key = tuple((s.nodes, s.recompute) for s in p.segments)
            if key not in seen:
                seen.add(key)
                candidates.append(p)
    return candidates


def _region_inputs(graph: Graph, plan: Plan) -> list[int]:
    """The storages the plan's replaying regions keep as inputs (its checkpoints)."""
    out: set[int] = set()
    for seg in plan.segments:
        if region_stop(graph, seg) >= 0:
            members = set(seg.nodes)
            out |= {graph.root(u) for v in seg.nodes for u in graph.pred(v) if u not in members}
    return sorted(r for r in out if graph.node(r)["alloc_bytes"] > 0)


def _complete(graph: Graph, budget_bytes: int, cfg: dict[str, Any], bandwidth: float,
              judged: list[tuple[tuple[int, float], Plan]], judge: Callable[[Plan], Any],
              best_time: Callable[[], float], least: list[int], units: bool) -> None:
    """Step 3 on the candidates ``judged`` (``units``: with the nodes' own saved tensors as offload
    candidates too, step 3b); completions go to ``judge``, least peaks of searches to ``least``."""
    from .offload_dag import OffloadSearch, offload_candidates, search_offloads

    completed: list[tuple[float, OffloadSearch]] = []
    for (peak, recompute_s), base in sorted(judged, key=lambda x: x[0][1]):
        if peak <= budget_bytes or recompute_s >= best_time():
            continue
        search = OffloadSearch(graph, base, budget_bytes, bandwidth)
        if search.judge(offload_candidates(graph, base, units)).peak > budget_bytes:
            least.append(search.least_peak if search.least_peak is not None else peak)
            continue  # even everything offloaded does not fit: no set is searched (module docstring)
        search_offloads(search, int(cfg["offload_grid"]), 0, seeds=[_region_inputs(graph, base)], prune=False,
                        units=units)
        least.append(search.least_peak if search.least_peak is not None else peak)
        best = search.best()
        if best is not None:
            judge(search.plan_of(best))
            completed.append((best.time, search))
    if completed:  # step 3's pruning, on the fastest completion only (it rarely changes the order)
        search = min(completed, key=lambda c: c[0])[1]
        search.prune()
        judge(search.plan_of(search.best()))


def solve_combined(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | CombinedConfig | None = None
                   ) -> Plan:
    from .beaumont import offload_bandwidth
    from .offload_dag import solve_offload_dag

    cfg = CombinedConfig.parse(config).as_dict()
    allow = offload_allowed(graph, cfg)
    bandwidth = offload_bandwidth(graph, cfg)
    tried: list[tuple[int, float, Plan]] = []  # (peak, extra time, plan)
    least: list[int] = []  # least peaks of searches whose plans are not in tried

    def judge(plan: Plan) -> tuple[int, float]:
        sim = simulate(graph, plan, check=False, record=False, bandwidth_bytes_per_s=bandwidth)
        tried.append((sim.peak_bytes, sim.extra_time_s, plan))
        return sim.peak_bytes, sim.extra_time_s

    def best_time() -> float:
        fits = [t for p, t, _ in tried if p <= budget_bytes]
        return min(fits) if fits else float("inf")

    candidates = _recompute_candidates(graph, budget_bytes, cfg)
    if allow:
        candidates += checkpoint_plans(graph, int(cfg["checkpoint_steps"]))
    judged = [(judge(p), p) for p in candidates]
    if allow:
        _complete(graph, budget_bytes, cfg, bandwidth, judged, judge, best_time, least, units=False)
        if cfg["saved_units"] and any(saved_unit_nodes(graph, p) for _, p in judged):
            _complete(graph, budget_bytes, cfg, bandwidth, judged, judge, best_time, least, units=True)
        try:
            judge(solve_offload_dag(graph, budget_bytes, config={"bandwidth_bytes_per_s": bandwidth, "offload": True,
                                                                 "saved_units": bool(cfg["saved_units"])}))
        except InfeasibleBudgetError as err:
            if err.min_budget_bytes is not None:
                least.append(int(err.min_budget_bytes))
    fits = [t for t in tried if t[0] <= budget_bytes]
    if not fits:
        raise InfeasibleBudgetError(budget_bytes, min([t[0] for t in tried] + least), solver="combined")
    fits.sort(key=lambda t: (t[1], t[0], len(t[2].offload) + len(t[2].offload_saved)))
    best = fits[0][2]
    best.solver = "combined"
    best.options = {**best.options, "offload_allowed": allow, "bandwidth_bytes_per_s": bandwidth}
    return best
