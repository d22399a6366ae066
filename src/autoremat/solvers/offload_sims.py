"""Simulations of offload sets on one base plan, memoised: shared by ``offload-dag`` and Beaumont's chain solvers.

An offload solver judges a set of units (storages, and ``-1 - v``: node ``v``'s own saved tensors)
by simulating the base plan offloading them at a prefetch depth, with the forward waits derived
at a memory limit (or none): :meth:`OffloadSims.run`. What that simulation predicts depends on the
graph, the base plan, the bandwidth and those three things only, not on the budget being solved
for, so one :class:`OffloadSims` answers every repeat from memory: within one solve (``offload-dag``
judges its chain seeds' sets again; ``offload-greedy`` and ``offload-dp`` scan the same
production-order prefixes) and across the solves of :func:`autoremat.solvers.min_budget`, which
probes a solver at budget 0, at the least peak that solve reports and one byte below it
(:func:`least_budget_run`: on a 64-layer GPT-2 at op level, 4,307 nodes, three ``offload-dag``
solves simulated 1,018 plans, most of them the same sets). Every simulation runs through
:class:`autoremat.cost.repeated.RepeatedSimulator` (the simulator's own step). The graph must not
be edited while one is in use (a solver's call, or one ``min_budget``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cost import Simulation
from ..cost.repeated import RepeatedSimulator
from ..graph import Graph
from ..plan import Plan

__all__ = ["OffloadSims", "least_budget_run", "MEMOISED_LEAST", "memoised_solver"]

MEMOISED_LEAST = ("offload-dag", "offload-greedy", "offload-dp", "vdnn")
"""The solvers whose :func:`~autoremat.solvers.min_budget` search shares one :class:`OffloadSims`."""


class OffloadSims:
    """Simulated offload sets on ``base`` at ``bandwidth``, memoised by (units, depth, wait limit)."""

    def __init__(self, graph: Graph, base: Plan, bandwidth: float) -> None:
        self.graph, self.base, self.bandwidth = graph, base, float(bandwidth)
        self.run_plan = RepeatedSimulator(graph)
        self.memo: dict[tuple[tuple[int, ...], int, int | None], Simulation] = {}
        self.chains: dict[Any, Any] = {}
        """What a chain solver built from the graph alone (its offloadable chain, per grouping)."""

    def plan(self, units: tuple[int, ...], waits: dict[int, int] | None = None, depth: int = 1) -> Plan:
        """The base plan offloading ``units`` (node outputs, and ``-1 - v``: node ``v``'s own saved tensors)."""
        base = self.base
        return Plan(list(base.segments), solver=base.solver, options=dict(base.options),
                    offload=tuple(u for u in units if u >= 0), offload_saved=tuple(-1 - u for u in units if u < 0),
                    offload_waits=dict(waits or {}), replay_tails=dict(base.replay_tails),
                    offload_prefetch_depth=depth)

    def run(self, units: tuple[int, ...], depth: int = 1, limit: int | None = None) -> Simulation:
        """``simulate`` of :meth:`plan` (no explicit waits) with ``offload_wait_limit_bytes=limit``;
        ``units`` sorted. Memoised: the caller must not change what it returns."""
        key = (units, depth, limit)
        sim = self.memo.get(key)
        if sim is None:
            sim = self.run_plan(self.plan(units, None, depth), bandwidth_bytes_per_s=self.bandwidth,
                                offload_wait_limit_bytes=limit)
            self.memo[key] = sim
        return sim

    def matches(self, graph: Graph, base: Plan, bandwidth: float) -> bool:
        """Whether these simulations are those of ``graph``, ``base`` and ``bandwidth``."""
        return (graph is self.graph and float(bandwidth) == self.bandwidth
                and (base is self.base or (list(base.segments) == list(self.base.segments)
                                           and dict(base.replay_tails) == dict(self.base.replay_tails))))


def memoised_solver(solver: str) -> Callable[..., Any]:
    """The solve function :func:`least_budget_run` stands for (``min_budget`` uses it only while it is registered)."""
    from .beaumont import solve_offload_dp, solve_offload_greedy, solve_vdnn
    from .offload_dag import solve_offload_dag

    return {"offload-dag": solve_offload_dag, "offload-greedy": solve_offload_greedy, "offload-dp": solve_offload_dp,
            "vdnn": solve_vdnn}[solver]


def least_budget_run(graph: Graph, solver: str, config: dict[str, Any] | None) -> Callable[[int], bool]:
    """``meets(budget)`` for :func:`autoremat.solvers.min_budget`'s search on one of :data:`MEMOISED_LEAST`:
    whether ``solver`` meets the budget (raising its :class:`~autoremat.errors.InfeasibleBudgetError`
    where not, as its solve does), every call sharing one :class:`OffloadSims`. ``offload-dag`` stops at
    the first plan that fits (whether it meets the budget is all the search asks; the fastest plan
    is the solve's work): the same answer as its solve, whose sets are judged in the same order and
    which fails only after judging every one."""
    from ..cost import no_recompute_plan
    from .beaumont import offload_bandwidth, solve_chain_offload
    from .offload_dag import OffloadDagConfig, dag_meets

    name = "offload-greedy" if solver == "offload-dag" else solver
    cfg = dict(config or {})
    if solver == "offload-dag":
        cfg = OffloadDagConfig.parse(config).as_dict()
    sims = OffloadSims(graph, no_recompute_plan(graph), offload_bandwidth(graph, cfg))
    if solver == "offload-dag":
        return lambda budget: dag_meets(graph, budget, cfg, sims)

    def meets(budget: int) -> bool:
        solve_chain_offload(graph, budget, name, cfg, sims)
        return True

    return meets
