"""Exceptions raised by autoremat."""

from __future__ import annotations

__all__ = ["InfeasibleBudgetError", "PlanMismatchError", "PlanFormatError"]


def _fmt_bytes(n: int) -> str:
    """Human-readable binary size, e.g. ``'1.50 MiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable, please report")


class InfeasibleBudgetError(ValueError):
    """No plan of the requested solver fits the budget.

    ``min_budget_bytes`` is the smallest step-peak budget the solver can meet on this graph
    (``None`` only when the solver could not determine it).
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int | None, *, solver: str) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.solver = solver
        need = "unknown" if min_budget_bytes is None else _fmt_bytes(min_budget_bytes)
        super().__init__(
            f"solver {solver!r} found no plan within a step-peak budget of {_fmt_bytes(budget_bytes)} "
            f"({budget_bytes} bytes); the smallest budget it can meet is {need}"
            f"{'' if min_budget_bytes is None else f' ({min_budget_bytes} bytes)'}. "
            "Raise the budget, lower the batch size, or try another solver (autoremat.SOLVERS)."
        )


class PlanMismatchError(ValueError):
    """A plan was applied to a model (or simulated on a graph) it was not made for."""


class PlanFormatError(ValueError):
    """A plan (a dict, JSON text or a plan file) is malformed: a field is missing, has the wrong
    type or is out of range, or the segments contradict each other.

    ``field`` is the dotted path of the offending field (``"segments[2].recompute"``; ``""``
    for the document as a whole). The message names the field, what was found and what is
    expected.
    """

    def __init__(self, field: str, problem: str, *, source: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        what = f"plan field {field!r}: " if field else "plan: "
        super().__init__(f"{where}{what}{problem}")
