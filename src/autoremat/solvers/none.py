"""``"none"``: no recomputation. The baseline every other solver is compared with.

Time O(n); exact (there is one plan). Infeasible when the unoptimised step peak exceeds the
budget; ``min_budget_bytes`` is then that peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import InfeasibleBudgetError
from ..graph import Graph
from ..plan import Plan
from ..cost import no_recompute_plan, simulate
from ._config import SolverConfig

__all__ = ["solve_none", "NoneConfig"]


@dataclass(frozen=True)
class NoneConfig(SolverConfig):
    """``none`` takes no options."""

    solver: ClassVar[str] = "none"


def solve_none(graph: Graph, budget_bytes: int, *, config: dict[str, Any] | NoneConfig | None = None) -> Plan:
    NoneConfig.parse(config)
    plan = no_recompute_plan(graph)
    peak = simulate(graph, plan, check=False, record=False).peak_bytes
    if peak > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, peak, solver="none")
    return plan
