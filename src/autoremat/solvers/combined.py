"""``"combined"``: one planner for recomputation and offloading under one budget.

Problem: among plans that recompute some segments and offload some of the tensors the kept
segments save, find one whose simulated step peak fits the budget with the least predicted
step time (forward + backward + recomputation + time backward waits for prefetches).

Method (a heuristic; the papers solve each half, not the mix — Kusumoto et al. and Beaumont
et al., see :mod:`autoremat.cost` for the transfer model):

1. *Recomputation candidates*: the plan without recomputation, and the plans of the base
   recomputation solvers (``bases``, default ``("chen", "dp-approx")`` where registered) solved
   at budgets on a geometric grid from the target up to the unoptimised peak (``budget_steps`` values,
   default 8) — looser budgets recompute less and leave more for offload to absorb.
2. *Offload completion*: for each candidate, the storages that its kept segments save are
   ordered by production (the earliest are needed last in backward, so their transfers have the
   most compute to hide behind); prefixes of that order are simulated on an even grid of
   lengths (``offload_grid``, default 48), then at every length around the grid point with the
   lowest peak and just below the first fitting one. Neither peak nor stall time is monotone in
   the prefix length (offloading more keeps the link busy, so copies finish later and hold
   memory longer), and the fitting lengths can form a narrow window, hence no bisection.
3. The fitting plan with the least predicted step time wins. Because the plain recomputation
   plan at the target budget and the offload-only plan are both candidates, the result is never
   predicted slower than the better of recomputation alone and offload alone.

Offloading only saves memory where there is a separate device: it is considered when the graph
was captured on CUDA or on the meta device (a model of one), or when ``offload=True``; on a
CPU-only capture the planner returns recomputation-only plans (``offload=False`` forces that).

Time: O(budget_steps · |bases| · (solve + offload_grid · simulate)); space O(n). Infeasible budgets raise
``InfeasibleBudgetError`` with the least simulated peak among all candidates tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan, offloadable_nodes
from ..cost import no_recompute_plan, simulate, unoptimised_peak_bytes
from ._config import SolverConfig

__all__ = ["solve_combined", "offload_allowed", "CombinedConfig"]


@dataclass(frozen=True)
class CombinedConfig(SolverConfig):
    """Options of ``combined`` (see the module docstring)."""

    solver: ClassVar[str] = "combined"
    renamed: ClassVar[dict[str, str]] = {"grid": "budget_steps"}
    bases: tuple[str, ...] = field(default=("chen", "dp-approx"), metadata={
        "help": "recomputation solvers whose plans are completed with offloads (registered ones are used)"})
    budget_steps: int = field(default=8, metadata={
        "help": "budgets per base solver, geometric from the target to the peak"})
    offload_grid: int = field(default=48, metadata={"help": "offload prefix lengths simulated per candidate"})
    bandwidth_bytes_per_s: float | None = field(default=None, metadata={
        "help": "host<->device bandwidth (default graph.meta's, else the simulator's default)"})
    offload: bool | str = field(default="auto", metadata={
        "help": "True, False, or 'auto' (offload on CUDA and meta captures)"})


def offload_allowed(graph: Graph, config: dict[str, Any]) -> bool:
    """Whether offloading can save device memory for this graph (see the module docstring)."""
    if "offload" in config and config["offload"] != "auto":
        return bool(config["offload"])
    device = str(graph.meta.get("device", ""))
    return device.startswith("cuda") or device == "meta"


def solve_combined(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | CombinedConfig | None = None
                   ) -> Plan:
    from . import SOLVERS, bare_solver  # the registry imports this module

    cfg = CombinedConfig.parse(config).as_dict()
    bases = [b for b in cfg["bases"] if b in SOLVERS]
    steps = int(cfg["budget_steps"])
    bandwidth = cfg["bandwidth_bytes_per_s"]
    allow = offload_allowed(graph, cfg)
    vanilla = unoptimised_peak_bytes(graph)
    tried: list[tuple[int, float, Plan]] = []

    def judge(plan: Plan) -> tuple[int, float]:
        sim = simulate(graph, plan, check=False, record=False, bandwidth_bytes_per_s=bandwidth)
        tried.append((sim.peak_bytes, sim.extra_time_s, plan))
        return sim.peak_bytes, sim.extra_time_s

    candidates: list[Plan] = [no_recompute_plan(graph)]
    targets = [budget_bytes] if vanilla <= budget_bytes else [
        int(budget_bytes * (vanilla / max(budget_bytes, 1)) ** (i / max(1, steps - 1))) for i in range(steps)]
    seen: set[tuple] = {tuple((s.nodes, s.recompute) for s in candidates[0].segments)}
    for base in bases:
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
    for base_plan in candidates:
        peak, _ = judge(base_plan)
        if peak <= budget_bytes or not allow:
            continue
        order = sorted(offloadable_nodes(graph, base_plan))
        if not order:
            continue

        def with_offload(k: int, base_plan: Plan = base_plan, order: list[int] = order) -> Plan:
            return Plan(list(base_plan.segments), solver="combined", options=dict(base_plan.options),
                        offload=tuple(order[:k]))

        # Neither the peak nor the stalls are monotone in the prefix length (offloading more keeps
        # the link busy, so copies finish later and hold memory longer), and the lengths that fit
        # can form a narrow window: scan an even grid of lengths, then every length around the
        # grid point with the lowest peak and around the first one that fits.
        n = len(order)
        points = min(n, int(cfg["offload_grid"]))
        step = max(1, n // points)
        grid = sorted({min(n, 1 + i * step) for i in range(points)} | {n})
        peaks = {k: judge(with_offload(k))[0] for k in grid}
        best_k = min(grid, key=lambda k: peaks[k])
        first_fit = next((k for k in grid if peaks[k] <= budget_bytes), None)
        around = set(range(max(1, best_k - step), min(n, best_k + step) + 1))
        if first_fit is not None:
            around |= set(range(max(1, first_fit - step), first_fit))
        for k in sorted(around - set(grid)):
            judge(with_offload(k))
    fits = [t for t in tried if t[0] <= budget_bytes]
    if not fits:
        raise InfeasibleBudgetError(budget_bytes, min(t[0] for t in tried), solver="combined")
    fits.sort(key=lambda t: (t[1], t[0], len(t[2].offload)))
    best = fits[0][2]
    best.options = {**best.options, "offload_allowed": allow}
    return best
