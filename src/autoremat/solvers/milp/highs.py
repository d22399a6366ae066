"""The HiGHS back end of ``"milp"``: a sparse model builder and one solve with a time limit.

``highspy`` is an optional dependency (``pip install "autoremat[milp]"``); :func:`load_highspy`
imports it on first use and names the extra when it is missing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Builder", "MilpResult", "load_highspy", "MISSING_HIGHSPY"]

logger = logging.getLogger("autoremat.solvers.milp")

MISSING_HIGHSPY = ('the "milp" solver needs the HiGHS solver\'s Python package highspy; install it with '
                   'pip install "autoremat[milp]" (or pip install highspy), or pick another solver')


def load_highspy() -> Any:
    """The ``highspy`` module, or an ``ImportError`` that names the extra to install."""
    try:
        import highspy
    except ImportError as err:  # pragma: no branch - exercised by a monkeypatched import in the tests
        raise ImportError(MISSING_HIGHSPY) from err
    return highspy


@dataclass
class MilpResult:
    """One HiGHS run: ``status`` is ``"optimal"``, ``"infeasible"``, ``"time_limit"`` (with or
    without a solution) or ``"other"``; ``bound`` is the proven lower bound of the objective
    (``inf`` when infeasible), ``values`` the best solution found (``None`` when none)."""

    status: str
    objective: float | None
    bound: float
    values: np.ndarray | None
    seconds: float


class Builder:
    """Columns and rows of a mixed-integer program, collected in Python and passed to HiGHS at once;
    rows added after :meth:`build` (no-good cuts) go straight to the solver."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.h: Any = None

    def var(self, cost: float = 0.0, lb: float = 0.0, ub: float = 1.0, integer: bool = True) -> int:
        self.cost.append(float(cost))
        self.lb.append(float(lb))
        self.ub.append(float(ub))
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float], lb: float, ub: float) -> int:
        """``lb <= sum(coef * x[col]) <= ub``; returns the row index."""
        terms = {c: v for c, v in terms.items() if v != 0.0}
        if self.h is not None:
            hs = self.h
            idx = np.array(list(terms), dtype=np.int32)
            val = np.array(list(terms.values()), dtype=np.float64)
            hs.addRow(float(lb), float(ub), len(idx), idx, val)
            return hs.getNumRow() - 1
        self.rows.append((terms, float(lb), float(ub)))
        return len(self.rows) - 1

    def build(self, highspy: Any, threads: int | None = None) -> Any:
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("mip_abs_gap", 1e-9)
        if threads:
            h.setOptionValue("threads", int(threads))
        n = len(self.cost)
        h.addCols(n, np.array(self.cost), np.array(self.lb), np.array(self.ub), 0,
                  np.zeros(n + 1, dtype=np.int32)[:0], np.zeros(0, dtype=np.int32), np.zeros(0))
        starts, index, value, lower, upper = [], [], [], [], []
        for terms, lo, hi in self.rows:
            starts.append(len(index))
            index.extend(terms)
            value.extend(terms.values())
            lower.append(lo)
            upper.append(hi)
        if self.rows:
            h.addRows(len(self.rows), np.array(lower), np.array(upper), len(index),
                      np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value))
        ints = [i for i in range(n) if self.integer[i]]
        if ints:
            h.changeColsIntegrality(len(ints), np.array(ints, dtype=np.int32),
                                    np.array([highspy.HighsVarType.kInteger] * len(ints)))
        if n > 5000:  # zoo-sized programs: presolve's probing costs more than it saves (ResNet-50 at
            h.setOptionValue("presolve", "off")  # CPU size: root bound after 12 s without it, 30 s with)
        h.changeObjectiveSense(highspy.ObjSense.kMinimize)
        self.h = h
        return h


def run(h: Any, highspy: Any, time_limit_s: float, cutoff: float | None = None) -> MilpResult:
    """Solve within ``time_limit_s``; ``cutoff`` prunes solutions whose objective is above it."""
    h.setOptionValue("time_limit", max(0.05, float(time_limit_s)))
    h.setOptionValue("objective_bound", float("inf") if cutoff is None else float(cutoff))
    start = time.monotonic()
    h.run()
    seconds = time.monotonic() - start
    ms = h.getModelStatus()
    info = h.getInfo()
    st = highspy.HighsModelStatus
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    values = np.asarray(h.getSolution().col_value) if has_sol else None
    if ms == st.kOptimal:
        obj = info.objective_function_value
        return MilpResult("optimal", obj, obj, values, seconds)
    if ms in (st.kInfeasible, st.kUnboundedOrInfeasible) or (ms == st.kObjectiveBound and not has_sol):
        return MilpResult("infeasible", None, float("inf"), None, seconds)
    bound = info.mip_dual_bound
    bound = float(bound) if np.isfinite(bound) else float("-inf")
    if ms == st.kTimeLimit:
        return MilpResult("time_limit", info.objective_function_value if has_sol else None, bound, values, seconds)
    logger.warning("milp: HiGHS stopped with status %s", h.modelStatusToString(ms))
    return MilpResult("other", info.objective_function_value if has_sol else None, bound, values, seconds)
