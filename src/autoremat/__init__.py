"""autoremat: train larger models and batches on the GPU you have.

Capture a model's computation graph, choose what to recompute under a memory budget, and
patch the model in place; gradients stay bit-for-bit what they were::

    import autoremat
    g = autoremat.capture(model, (x,))                  # profiled computation graph
    plan = autoremat.solve(g, "50%", solver="chen")      # checkpoint plan under a budget
    autoremat.apply(model, plan)                         # patched in place
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import zoo
from .budget import parse_budget
from .capture import CaptureDoesNotFitError, capture, capture_within
from .capture.signature import check_inputs
from .errors import CallCountError, InfeasibleBudgetError, ModelRecomputesError, PlanFormatError, PlanMismatchError
from .graph import Graph
from .measure import Measurement, is_profiling, measure
from .plan import Plan, Segment, validate_plan
from .runtime import apply, is_patched, restore
from .cost import Simulation, simulate
from .solvers import SOLVERS, min_budget, solve

if TYPE_CHECKING:
    from .integrations.lightning import AutoRemat

__version__ = "0.1.0"

__all__ = [
    "AutoRemat", "Graph", "Plan", "Segment", "Simulation", "Measurement",
    "capture", "capture_within", "CaptureDoesNotFitError", "solve", "simulate", "apply", "restore", "is_patched", "measure",
    "is_profiling",
    "validate_plan", "parse_budget", "SOLVERS", "min_budget",
    "InfeasibleBudgetError", "PlanMismatchError", "PlanFormatError", "CallCountError", "ModelRecomputesError",
    "check_inputs", "zoo", "__version__",
]


def __getattr__(name: str) -> Any:
    """``autoremat.AutoRemat`` imports Lightning on first use, so ``import autoremat`` stays light."""
    if name == "AutoRemat":
        from .integrations.lightning import AutoRemat

        globals()["AutoRemat"] = AutoRemat
        return AutoRemat
    raise AttributeError(f"module 'autoremat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"AutoRemat"})
