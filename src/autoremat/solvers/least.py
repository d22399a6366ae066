"""``budget="min"``: the least step-peak budget a solver, or ``"auto"``'s solvers, reach on a graph.

:func:`least_budget` is what :func:`autoremat.solve` resolves ``budget="min"`` to, and what
the integrations and the CLI print as the low end of the reachable range. For a named solver
it is :func:`autoremat.solvers.min_budget`; for ``"auto"`` it is the least over the solvers
``"auto"`` tries (the same list and the same offload filter as :func:`autoremat.solve`), so
that ``solve(graph, least_budget(graph))`` always finds a plan. Cost: one ``min_budget`` per
solver tried (chen: two or three solves; dp-approx: its own search; see
:mod:`autoremat.solvers.minimum`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..graph import Graph
from ..cost import unoptimised_peak_bytes

__all__ = ["least_budget", "auto_order"]

logger = logging.getLogger(__name__)


def auto_order(graph: Graph, options: Mapping[str, Any], auto_solvers: Sequence[str] | None = None) -> tuple[str, ...]:
    """The solvers ``solve(..., solver="auto")`` tries on ``graph``, in order (``"none"`` first).

    On a graph whose repeated blocks were captured op by op (``graph.meta["blocks"] == "ops"``)
    the solvers that plan single nodes are left out (logged): they cannot recompute inside the
    blocks, so what they reach there is Chen's whole-block plans (dp-approx checks its own against
    them), which ``chen`` before them already tried, and ``blocks`` plans the same regions and
    more. Measured on transformers GPT-2 of 2, 4 and 6 layers at op level (meta device) at 75 %,
    50 % and 30 %: dp-approx and combined returned exactly chen's plan (same predicted time)
    each time, ``blocks`` a faster one, and they took up to 4 s and 1.6 s of the solve."""
    from . import AUTO_ORDER, offload_allowed, plans_single_nodes

    order = AUTO_ORDER if auto_solvers is None else tuple(n for n in AUTO_ORDER if n in auto_solvers or n == "none")
    if not offload_allowed(graph, dict(options)):
        order = tuple(n for n in order if n != "combined")
    if graph.meta.get("blocks") == "ops":
        left = tuple(n for n in order if plans_single_nodes(n))
        if left:
            logger.info("solver='auto': %s left out: this graph's blocks were captured op by op and they plan single "
                        "nodes (they reach Chen's whole-block plans there; autoremat.solvers.least.auto_order)",
                        ", ".join(left))
            order = tuple(n for n in order if not plans_single_nodes(n))
    return order


def least_budget(graph: Graph, solver: str = "auto", *, auto_solvers: Sequence[str] | None = None,
                 **options: Any) -> int:
    """The least step-peak budget ``solver`` meets on ``graph`` (``"auto"``: the least of the
    solvers it tries), never above the unoptimised step peak."""
    from . import _accepted, check_solver, min_budget

    check_solver(solver)
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an autoremat.Graph (from autoremat.capture), got {type(graph).__name__}")
    peak = unoptimised_peak_bytes(graph)
    if solver != "auto":
        return min(peak, min_budget(graph, solver, config=dict(options) or None)) if solver != "none" else \
            min_budget(graph, "none")
    best = peak
    for name in auto_order(graph, options, auto_solvers):
        if name == "none":
            continue
        least = min_budget(graph, name, config=_accepted(name, options) or None)
        logger.info("least budget of %s: %d bytes", name, least)
        best = min(best, least)
    return best
