"""autoremat: train larger models and batches on the GPU you have.

Capture a model's computation graph, choose what to recompute under a memory budget, and
patch the model in place; gradients stay bit-for-bit what they were::

    import autoremat
    g = autoremat.capture(model, (x,))                  # profiled computation graph
    plan = autoremat.solve(g, "50%", solver="chen")      # checkpoint plan under a budget
    autoremat.apply(model, plan)                         # patched in place
"""

from __future__ import annotations

from . import zoo
from .budget import parse_budget
from .capture import CaptureDoesNotFitError, capture, capture_within
from .errors import InfeasibleBudgetError, PlanMismatchError
from .graph import Graph
from .integrations.lightning import AutoRemat
from .measure import Measurement, measure
from .plan import Plan, Segment, validate_plan
from .runtime import apply, is_patched, restore
from .simulate import Simulation, simulate
from .solvers import SOLVERS, min_budget, solve

__version__ = "0.1.0"

__all__ = [
    "AutoRemat", "Graph", "Plan", "Segment", "Simulation", "Measurement",
    "capture", "capture_within", "CaptureDoesNotFitError", "solve", "simulate", "apply", "restore", "is_patched", "measure",
    "validate_plan", "parse_budget", "SOLVERS", "min_budget",
    "InfeasibleBudgetError", "PlanMismatchError", "zoo", "__version__",
]
