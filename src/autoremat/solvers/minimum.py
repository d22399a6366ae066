"""``min_budget(graph, solver)``: the least step-peak budget a registered solver meets.

* ``auto`` (the default, as :func:`autoremat.solve`'s): the least of the solvers ``solve`` tries,
  :func:`.least.least_budget`.
* ``dp-approx`` and ``dp-exact``: their own search (:func:`.kusumoto.min_budget`), exact for
  the DP's family (see :mod:`.kusumoto`).
* ``milp``: its memory-centric program (:func:`.milp.min_budget_milp`).
* ``none``: the unoptimised step peak (its one plan).
* ``chen``: the least simulated peak of the plans it tries (:func:`.chen.min_budget_chen`: one
  pass over them; the search below took four, 280 simulated steps on a 64-layer GPT-2 at op level).
* ``offload-dag``, ``offload-greedy``, ``offload-dp``, ``vdnn``: the search below, its solves sharing
  one memo of simulated offload sets (:func:`.offload_sims.least_budget_run`; ``offload-dag`` stops
  each solve at the first plan that fits): the same answer as solving afresh each time.
* Every other registered solver (no closed form): a search over budgets with the solver's own
  feasibility. It starts from a budget the solver fails (0, unless it meets 0) and one it meets
  (the unoptimised peak, which every registered solver meets by returning the plan without
  recomputation; if it does not, the budget is doubled up to 64 times the peak), probes the
  ``min_budget_bytes`` that each :class:`~autoremat.errors.InfeasibleBudgetError` reports
  first (for solvers that pick the best of a budget-independent candidate set, such as
  ``chen``, that is the answer, found in two or three solves), and the simulated peak of each plan
  it returns (the answer is at most that where the solver is monotone; ``combined``'s least budget
  on the CPU-size GoogLeNet took 25 solves by bisection), and otherwise bisects.

Refused: a solver that plans single nodes (:func:`autoremat.solvers.plans_single_nodes`: not a
region solver, not offload-only) on a large module-level graph whose repeated blocks were
captured op by op (:func:`autoremat.solvers.large_op_capture`: capture's default, at least
``AUTO_BLOCKS_ENOUGH_NODES`` nodes, where ``auto`` does not ask them either) raises a
``ValueError`` at once, naming what to use instead: it cannot recompute inside the blocks, and
its search over every op is what it would spend its time on (a 64-layer GPT-2, 4,307 nodes:
dp-approx, dp-exact, reforward, combined and milp each ran over 60 s without an answer; issue 24).

Decision: the result ``b`` always satisfies "the solver meets ``b`` and fails ``b - 1``" (both
were run). It is the least budget the solver meets when feasibility is monotone in the budget
(a larger budget never makes it fail); a solver that is not monotone may meet some budget below
a failing one, which this search cannot see without trying every budget. Cost: two solves plus
one per bisection step, at most ``log2(peak)`` (about 30 for a GB-sized peak).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..cost import no_recompute_plan, simulate
from ..plan import Plan
from . import kusumoto
from .offload_sims import MEMOISED_LEAST, least_budget_run, memoised_solver

__all__ = ["min_budget"]

logger = logging.getLogger(__name__)

_MAX_DOUBLINGS = 6


def min_budget(graph: Graph, solver: str = "auto", *, config: Mapping[str, Any] | None = None) -> int:
    """The least step-peak budget ``solver`` meets on ``graph`` (see the module docstring).

    ``config``: the solver's options (:data:`autoremat.solvers.CONFIGS`), as for ``solve``.
    ``"auto"`` (the default, as ``solve``'s): the least of the solvers ``solve`` tries,
    :func:`.least.least_budget`, so ``solve(graph, min_budget(graph))`` finds a plan.
    """
    from . import bare_solver, check_solver  # the registry imports this module

    from . import refuse_large_op_capture

    if solver == "auto":
        from .least import least_budget

        return least_budget(graph, "auto", **dict(config or {}))
    check_solver(solver, allow_auto=False)
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an autoremat.Graph (from autoremat.capture), got {type(graph).__name__}")
    refuse_large_op_capture(graph, solver, "min_budget")
    if solver in ("dp-approx", "dp-exact"):
        return kusumoto.min_budget(graph, solver, config=None if config is None else dict(config))
    if solver == "milp":  # its own memory-centric mixed-integer program (autoremat.solvers.milp)
        from .milp import min_budget_milp

        return min_budget_milp(graph, config=None if config is None else dict(config))
    if solver == "none":
        return simulate(graph, no_recompute_plan(graph), check=False, record=False).peak_bytes
    if solver == "chen":
        from .chen import min_budget_chen

        return min_budget_chen(graph, config=None if config is None else dict(config))
    fn = bare_solver(solver)
    if solver in MEMOISED_LEAST and fn is memoised_solver(solver):  # the same solves, one memo of simulations
        return _searched(graph, least_budget_run(graph, solver, None if config is None else dict(config)), solver)
    return _searched(graph, lambda b: fn(graph, b, config=None if config is None else dict(config)), solver)


def _searched(graph: Graph, run: Any, solver: str) -> int:
    """Least ``b`` with ``run(b)`` succeeding and ``run(b - 1)`` raising InfeasibleBudgetError."""
    hints: list[int] = []

    def meets(budget: int) -> bool:
        try:
            got = run(budget)
        except InfeasibleBudgetError as err:
            if err.min_budget_bytes is not None:
                hints.append(int(err.min_budget_bytes))
            return False
        if isinstance(got, Plan) and (got.recompute_segments or got.offloads):  # its own peak: a hint too
            hints.append(got.predicted_peak_bytes or simulate(graph, got, check=False, record=False).peak_bytes)
        return True

    if meets(0):
        return 0
    bad = 0
    good = simulate(graph, no_recompute_plan(graph), check=False, record=False).peak_bytes
    for _ in range(_MAX_DOUBLINGS):
        if meets(good):
            break
        bad, good = good, 2 * max(good, 1)
    else:
        raise AssertionError(f"solver {solver!r} meets no budget up to {good} bytes, 64x the unoptimised peak; "
                             "please report")
    tried: set[int] = set()
    while good - bad > 1:
        hint = next((h for h in reversed(hints) if bad < h < good and h not in tried), None)
        if hint is None:
            mid = (bad + good) // 2
            good, bad = (mid, bad) if meets(mid) else (good, mid)
            continue
        tried.add(hint)
        if not meets(hint):
            bad = hint
        elif hint - 1 > bad and not meets(hint - 1):  # the hint is the answer: two solves
            good, bad = hint, hint - 1
        else:
            good = hint
    logger.info("min_budget(%s): %d bytes", solver, good)
    return good
