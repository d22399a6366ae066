"""What every integration needs, defined once: the device budget turned into a step budget, and
how a module-level model's repeated blocks are captured for the solver (:func:`capture_blocks`).

Resident bytes, the device of a model and optimizer-state accounting live in
:mod:`autoremat.resident` (capture uses them too); the solver-name check is
:func:`autoremat.solvers.check_solver`; batch-size scaling of a graph is :meth:`Graph.scaled`;
the batch-size search is :mod:`autoremat.integrations.batch_size`. Nothing here imports a
training framework, so the Accelerate path never loads Lightning.
"""

from __future__ import annotations

import torch

from .._units import fmt_bytes
from ..budget import parse_budget
from ..graph import Graph
from ..cost import unoptimised_peak_bytes
from ..solvers import REGION_SOLVERS

__all__ = ["step_budget_bytes", "is_percentage", "capture_blocks"]


def capture_blocks(solver: str) -> str:
    """``capture(blocks=)`` for ``solver``: op by op (the default) for the solvers that plan
    module-call regions of such a capture (:data:`autoremat.solvers.REGION_SOLVERS`); one node per
    block for the others, which recompute single nodes and cannot recompute an op inside a block."""
    return "auto" if solver in REGION_SOLVERS else "module"


def is_percentage(budget: int | float | str) -> bool:
    """Whether ``budget`` is a fraction of the unoptimised step peak (``"50%"`` or ``0.5``)."""
    return isinstance(budget, float) or (isinstance(budget, str) and budget.strip().endswith("%"))


def step_budget_bytes(budget: int | float | str, graph: Graph, device: torch.device | str,
                      resident_bytes: int, allocated_bytes: int | None = None) -> int:
    """The step-peak budget for a device budget (see DESIGN.md, "what memory means").

    ``"auto"``: free device memory (or available host memory on a CPU) minus a margin, minus the
    resident bytes that are not allocated yet (``resident_bytes - allocated_bytes``: free memory
    already excludes the allocated ones; optimizer state created at the first step and gradients
    are not, and they are resident from the second step on). ``allocated_bytes=None``: everything
    resident is allocated already. A percentage: of ``graph``'s unoptimised step peak. A size or
    byte count: minus ``resident_bytes`` (parameters, optimizer state, the batch).
    """
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        to_come = 0 if allocated_bytes is None else max(0, int(resident_bytes) - int(allocated_bytes))
        return parse_budget("auto", device=device, resident_bytes=to_come)
    if is_percentage(budget):
        return parse_budget(budget, unoptimised_peak_bytes=unoptimised_peak_bytes(graph))
    step = parse_budget(budget) - int(resident_bytes)
    if step <= 0:
        raise ValueError(f"budget={budget!r} is below what is resident before a step ({fmt_bytes(resident_bytes)}: "
                         "parameters, optimizer state, the batch); raise it")
    return step
