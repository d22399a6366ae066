"""Brute force over offload sets: the test oracle of ``offload-dag`` (issue 22).

Problem: on a fixed plan's segments (default: nothing recomputed), among every subset ``S`` of
the storages the plan keeps for backward (:func:`~autoremat.plan.offloadable_nodes`), each run
without forward waits, with the waits :func:`autoremat.cost.simulate` derives at the budget
(``offload_wait_limit_bytes``) and with those it derives at 0 (the forward waits for every copy
as soon as that frees memory), find one whose simulated step peak fits the budget with the least
extra time. Ties go to fewer offloaded bytes, then to the lower peak, then to no waits.

Method: enumerate all ``2^|C|`` subsets, three simulations each; no model of its own (it shares no
search code with ``offload-dag``, only the simulator both are judged by).

Complexity: ``3 · 2^|C|`` simulations of O(n + e); exact for that plan space. Small graphs
only: more than ``max_candidates`` candidates (default 12) is a ``ValueError``. Not registered
in :data:`autoremat.solvers.SOLVERS`.
"""

from __future__ import annotations

import itertools

from ...cost import DEFAULT_BANDWIDTH_BYTES_PER_S, no_recompute_plan, simulate
from ...errors import InfeasibleBudgetError
from ...graph import Graph
from ...plan import Plan, offloadable_nodes

__all__ = ["solve_offload_bruteforce"]


def solve_offload_bruteforce(graph: Graph, budget_bytes: int, *, base: Plan | None = None,
                             bandwidth_bytes_per_s: float | None = None, max_candidates: int = 12) -> Plan:
    """The fastest offload set (and forward waits) on ``base``'s segments that fits the budget."""
    base = no_recompute_plan(graph) if base is None else base
    bandwidth = (bandwidth_bytes_per_s or graph.meta.get("bandwidth_bytes_per_s")
                 or DEFAULT_BANDWIDTH_BYTES_PER_S)
    cands = sorted(offloadable_nodes(graph, base))
    if len(cands) > max_candidates:
        raise ValueError(f"{len(cands)} offload candidates; brute force takes at most max_candidates="
                         f"{max_candidates} (2^n subsets)")
    best: tuple | None = None
    least: int | None = None
    for k in range(len(cands) + 1):
        for subset in itertools.combinations(cands, k):
            plan = Plan(list(base.segments), offload=subset, replay_tails=dict(base.replay_tails))
            for limit in ((None, budget_bytes, 0) if subset else (None,)):
                sim = simulate(graph, plan, check=False, record=False, bandwidth_bytes_per_s=bandwidth,
                               offload_wait_limit_bytes=limit)
                least = sim.peak_bytes if least is None else min(least, sim.peak_bytes)
                if sim.peak_bytes > budget_bytes:
                    continue
                key = (sim.extra_time_s, sim.offloaded_bytes, sim.peak_bytes, limit is not None, subset)
                if best is None or key < best[0]:
                    best = (key, subset, dict(sim.offload_waits) if limit is not None else {})
    if best is None:
        raise InfeasibleBudgetError(budget_bytes, least, solver="offload-bruteforce")
    _key, subset, waits = best
    return Plan(list(base.segments), solver="offload-bruteforce", offload=subset, offload_waits=waits,
                replay_tails=dict(base.replay_tails), bandwidth_bytes_per_s=bandwidth)
