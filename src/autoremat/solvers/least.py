"""``budget="min"``: the least step-peak budget a solver, or ``"auto"``'s solvers, reach on a graph.

:func:`least_budget` is what :func:`autoremat.solve` resolves ``budget="min"`` to, and what
the integrations and the CLI print as the low end of the reachable range. For a named solver
it is :func:`autoremat.solvers.min_budget`; for ``"auto"`` it is the least over the solvers
``"auto"`` tries (the same list and the same offload filter as :func:`autoremat.solve`), so
that ``solve(graph, least_budget(graph))`` always finds a plan (on small graphs with
deterministic times the lattice search ``auto`` asks counts too: :func:`auto_lattice_least`). Cost: one ``min_budget`` per
solver tried (chen: two or three solves; dp-approx: its own search; see
:mod:`autoremat.solvers.minimum`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..graph import Graph
from ..cost import unoptimised_peak_bytes

__all__ = ["least_budget", "auto_order", "auto_lattice_least"]

logger = logging.getLogger(__name__)


def auto_order(graph: Graph, options: Mapping[str, Any], auto_solvers: Sequence[str] | None = None) -> tuple[str, ...]:
    """The solvers ``solve(..., solver="auto")`` tries on ``graph``, in order (``"none"`` first).

    On a module-level graph of at least :data:`~autoremat.solvers.AUTO_BLOCKS_ENOUGH_NODES` nodes
    whose repeated blocks were captured op by op (:func:`~autoremat.solvers.large_op_capture`) the
    solvers that plan single nodes are left out (logged): they cannot recompute inside the blocks,
    and on such graphs their searches over every op take minutes (a 64-layer GPT-2, 4,307 nodes:
    dp-approx, reforward, combined, milp, dp-exact each over 60 s for ``min_budget``) for what
    ``blocks`` and ``chen`` plan (on transformers GPT-2 of 2-6 layers at op level, at 75/50/30 %,
    dp-approx and combined returned exactly chen's plan each time, blocks a faster one). Smaller
    op-by-op graphs keep ``combined`` but not ``dp-approx`` either
    (:data:`~autoremat.solvers.AUTO_NOT_ON_OP_CAPTURES`)."""
    from . import AUTO_NOT_ON_OP_CAPTURES, AUTO_ORDER, large_op_capture, offload_allowed, plans_single_nodes

    order = AUTO_ORDER if auto_solvers is None else tuple(n for n in AUTO_ORDER if n in auto_solvers or n == "none")
    if not offload_allowed(graph, dict(options)):
        order = tuple(n for n in order if n != "combined")
    if large_op_capture(graph):
        left = tuple(n for n in order if plans_single_nodes(n))
        if left:
            logger.info("solver='auto': %s left out: this graph of %d nodes has its blocks captured op by op and they "
                        "plan single nodes (autoremat.solvers.least.auto_order)", ", ".join(left), len(graph))
            order = tuple(n for n in order if not plans_single_nodes(n))
    elif graph.ops_blocks:
        left = tuple(n for n in order if n in AUTO_NOT_ON_OP_CAPTURES)
        if left:
            logger.info("solver='auto': %s left out: this graph has its blocks captured op by op "
                        "(autoremat.solvers.AUTO_NOT_ON_OP_CAPTURES)", ", ".join(left))
            order = tuple(n for n in order if n not in left)
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
    lattice = auto_lattice_least(graph)
    if lattice is not None and lattice < best:
        logger.info("least budget of the lattice search (milp, for auto): %d bytes", lattice)
        best = lattice
    return best


def auto_lattice_least(graph: Graph) -> int | None:
    """The least budget ``auto``'s lattice searches reach on small graphs with deterministic times
    (:func:`autoremat.solvers.milp.exact.auto_least_peak` over every lower set,
    :func:`autoremat.solvers.milp.chain.chain_least_peak` over the chain search's rescue), else ``None``."""
    from .stable import is_measured

    if is_measured(graph):
        return None
    from .milp.chain import chain_least_peak
    from .milp.exact import auto_least_peak

    chain = chain_least_peak(graph)
    found = [x for x in (auto_least_peak(graph), None if chain is None else chain[0]) if x is not None]
    return min(found) if found else None
