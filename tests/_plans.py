"""Checks and enumerations shared by the solver tests.

* :func:`check_plan`: what every solver's plan must satisfy (valid, within its budget, its
  predictions the simulator's, the same after a JSON round trip).
* :func:`family_chains`: every increasing chain of a lower-set family from the empty set to ``V``.
* :func:`dp_outcome`: everything a caller sees from a Kusumoto DP at each budget and objective,
  as JSON gives it back: the protocol of the golden data (``solvers/kusumoto/golden``), used by
  the script that made it on the frozen reference and by ``test_golden.py`` on the solvers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from autoremat.cost import simulate
from autoremat.errors import InfeasibleBudgetError
from autoremat.graph import Graph
from autoremat.plan import Plan, validate_plan

__all__ = ["check_plan", "family_chains", "dp_outcome"]


def check_plan(graph: Graph, plan: Plan, budget_bytes: int, solver: str) -> None:
    """What every solver result must satisfy."""
    validate_plan(graph, plan)
    sim = simulate(graph, plan)
    assert plan.solver == solver
    assert plan.budget_bytes == budget_bytes
    assert plan.graph_fingerprint == graph.fingerprint
    assert plan.predicted_peak_bytes == sim.peak_bytes
    assert plan.predicted_extra_time_s == sim.extra_time_s
    assert sim.peak_bytes <= budget_bytes
    again = Plan.from_json(plan.to_json())  # the plan survives JSON and stays valid
    assert again == plan
    validate_plan(graph, again)


def family_chains(fam: list[int]) -> Iterator[list[int]]:
    """Every increasing chain of sets of ``fam`` from the empty set (index 0) to ``V`` (the last)."""
    last = len(fam) - 1

    def walk(i: int, prefix: list[int]) -> Iterator[list[int]]:
        if i == last:
            yield prefix
            return
        for j in range(1, last + 1):
            if j != i and fam[j] != fam[i] and not fam[i] & ~fam[j]:
                yield from walk(j, prefix + [fam[j]])

    yield from walk(0, [])


def dp_outcome(module: Any, graph: Graph, solver: str, budgets: list[int], config: dict) -> dict:
    """``module``'s ``min_budget`` and, at each budget and objective (in this order), its plan's
    segments, options, simulated peak and extra time, or the infeasible budget's minimum."""
    fn = module.solve_dp_exact if solver == "dp-exact" else module.solve_dp_approx
    out: dict = {"min": module.min_budget(graph, solver, config=config or None), "at": []}
    for budget in budgets:
        for objective in ("time", "memory"):
            try:
                plan = fn(graph, budget, config={**config, "objective": objective})
            except InfeasibleBudgetError as err:
                out["at"].append([budget, objective, ["infeasible", err.min_budget_bytes]])
                continue
            sim = simulate(graph, plan, check=False, record=False)
            out["at"].append([budget, objective, [[[list(s.nodes), s.recompute] for s in plan.segments],
                                                  plan.options, sim.peak_bytes, sim.extra_time_s]])
    return json.loads(json.dumps(out))
